"""What one masked block pair hands a one-call kernel, built from the pair's global positions (pure, host
side) and cached in the mask object like its block ops (:class:`~.blocks.MaskBlocks`):

* :func:`varlen_bands`: the flash varlen calls of a window / documents mask
  (:func:`burstattn.kernels.bands.pair_bands` over the rows' visible key ranges,
  :func:`~.blocks.visible_ranges`);
* :func:`flex_pair`: the FlexAttention block mask of any mask (:func:`burstattn.kernels.flex.flex_spec`
  over the block summary's tile classes, :func:`~.blocks.classify`).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..engine.pairs import positions_key
from ..kernels.bands import PairBands, pair_bands
from ..kernels.flex import FlexSpec, flex_spec
from .blocks import classify, visible_ranges
from .spec import AttnMask


def _key(name: str, causal: bool, seq_len: int, k_len: Optional[int], q_pos, k_pos) -> tuple:
    return (name, bool(causal), seq_len, k_len, positions_key(q_pos), positions_key(k_pos))


def varlen_bands(mask: AttnMask, causal: bool, q_pos: torch.Tensor, k_pos: torch.Tensor, seq_len: int,
                 k_len: Optional[int] = None) -> Optional[PairBands]:
    """The varlen calls of queries at ``q_pos [n_q]`` against keys at ``k_pos [n_k]`` (global positions, as
    :func:`~.blocks.mask_ops` takes them) under ``mask`` (no ``mask_mod``); ``None``: the pair keeps the
    engine's tiles (:func:`~burstattn.kernels.bands.pair_bands`)."""
    if mask.mask_mod is not None:
        raise ValueError("varlen_bands: a mask_mod is not a window or documents (FlexAttention takes it)")
    key = _key("bands", causal, seq_len, k_len, q_pos, k_pos)
    if key not in mask.cache:
        a, b = visible_ranges(mask, q_pos, k_pos, seq_len, causal, k_len)
        mask.cache[key] = pair_bands(a, b, int(k_pos.numel()))
    return mask.cache[key]


def flex_pair(mask: AttnMask, causal: bool, q_pos: torch.Tensor, k_pos: torch.Tensor, seq_len: int,
              k_len: Optional[int] = None, mask_mod=None) -> FlexSpec:
    """The FlexAttention block mask inputs of a pair (see :func:`varlen_bands` for the arguments);
    ``mask_mod``: the predicate the kernel evaluates (default the mask's own)."""
    key = _key("flex", causal, seq_len, k_len, q_pos, k_pos)
    if key not in mask.cache:
        lo, hi = mask.intervals(q_pos, seq_len, causal, k_len)
        cls = classify(mask, q_pos, k_pos, seq_len, causal, k_len)
        mask.cache[key] = flex_spec(cls, mask.block_size, q_pos, k_pos, lo, hi,
                                    mask.mask_mod if mask_mod is None else mask_mod)
    return mask.cache[key]

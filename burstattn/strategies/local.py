"""Attention of a whole sequence on one rank, for the strategies that gather a full sequence or full
heads onto a rank (ulysses, usp's Ulysses level, tp): the engine at a world of one.

The plan is the engine's (:func:`burstattn.engine.run.build_plan` over the positions ``0..N-1``: one
pair, one kernel call per block op), or under a mask its world-of-one mask plan, which computes only
the block ops the mask leaves non-empty. Gradient partials are the kernel's own (``grad_partials =
"kernel"``): one kernel call per op, as a single-device attention does.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from ..autograd import backward_pass, forward_pass
from ..config import AttnConfig
from ..groups import GroupContext
from ..kernels import resolve_backend
from ..masks.plan import MaskPlan, mask_plan

ALONE = GroupContext(None, 0, 1)


def _local(cfg: AttnConfig, q: torch.Tensor) -> AttnConfig:
    return replace(cfg, layout="contiguous", kv_layout=None, backend=resolve_backend(cfg.backend, q.device, q.dtype),
                   backward="kv", schedule="ring", topology=None, grad_partials="kernel")


def local_plan(cfg: AttnConfig, seq_len: int) -> Optional[MaskPlan]:
    """The world-of-one mask plan of ``cfg.mask`` over ``seq_len`` tokens in global order (``None``
    without a mask, or with an empty one)."""
    if cfg.mask is None or cfg.mask.empty:
        return None
    return mask_plan(cfg.mask, cfg.causal, seq_len, 1, "contiguous", 0)


def local_forward(cfg: AttnConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  plan: Optional[MaskPlan] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [B, N, Hq, D]``, ``k, v [B, N, Hkv, D]`` in global order -> ``out [B, N, Hq, D]`` (q's dtype)
    and ``lse [B, Hq, N]`` (float32; float64 for float64), causal on the global order."""
    return forward_pass(ALONE, _local(cfg, q), plan, q, k, v)


def local_backward(cfg: AttnConfig, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, plan: Optional[MaskPlan] = None):
    """Gradients of :func:`local_forward`: ``dq, dk, dv`` in the inputs' shapes and dtypes."""
    return backward_pass(ALONE, _local(cfg, q), plan, dout, q, k, v, out, lse)[:3]

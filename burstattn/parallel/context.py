"""Context parallelism: which global tokens each ``cp`` rank holds, and the attention it calls.

:func:`shard_positions` is the ONE function that says which global positions a context-parallel
rank holds for a strategy and layout; tokens, labels, target masks and rotary positions are all
cut with it, so they always agree with what the strategy's attention assumes.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..layouts.named import local_positions
from ..models import AttnCall
from ..strategies import STRATEGIES
from ..strategies.usp import usp_positions


def default_layout(strategy: str) -> str:
    """The layout ``strategy`` uses when none is given (the registry's default)."""
    return STRATEGIES[strategy].default_layout


def shard_positions(seq_len: int, *, strategy: str, layout: str, cp_rank: int, cp_size: int,
                    ulysses_degree: int = 1) -> torch.Tensor:
    """Global positions held by context-parallel rank ``cp_rank`` of ``cp_size``: LongTensor
    ``[seq_len // cp_size]``, increasing. ``usp``: its ring x Ulysses grid layout (the ring-level
    ``layout`` split contiguously inside each Ulysses group); every other strategy:
    :func:`burstattn.layouts.named.local_positions` (what ``shard_sequence`` does).

    Raises:
        ValueError: the length cannot be split so.
    """
    if strategy == "usp":
        ring_rank, ulysses_rank = divmod(cp_rank, ulysses_degree)
        return usp_positions(seq_len, ring_rank=ring_rank, ring_degree=cp_size // ulysses_degree,
                             ulysses_rank=ulysses_rank, ulysses_degree=ulysses_degree, layout=layout)
    return local_positions(seq_len, cp_rank, cp_size, layout)


def cp_attention(strategy: str, cp_group, layout: str, *, backend: str = "auto", usp_grid=None,
                 options: Optional[dict] = None, head_chunks: int = 1) -> AttnCall:
    """The causal attention over the ``cp`` group: an :class:`~burstattn.models.AttnCall`
    (``head_chunks``: over that many groups of heads, one after another).

    ``usp`` takes its grid from ``usp_grid`` (a 2-D ``("ring", "ulysses")`` mesh, see
    :func:`burstattn.parallel.mesh.build_usp_mesh`); ``rsa`` only runs the plain-matmul backend."""
    opts = dict(options or {})
    if "backend" in STRATEGIES[strategy].options:
        opts.setdefault("backend", "auto" if strategy == "rsa" and backend != "reference" else backend)
    if strategy == "usp":
        if usp_grid is None:
            raise ValueError("cp_attention: strategy 'usp' needs usp_grid (a ('ring', 'ulysses') DeviceMesh)")
        opts["mesh"] = usp_grid
    return AttnCall(strategy=strategy, group=cp_group, layout=layout, options=opts, head_chunks=head_chunks)

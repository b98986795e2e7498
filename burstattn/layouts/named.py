"""Sequence layouts: which global token positions each rank holds.

With P ranks and a global sequence of N tokens, every rank holds n = N / P tokens:

* ``contiguous``: rank r holds ``[r*n, (r+1)*n)``. Simple; causal work is imbalanced
  (rank P-1 does P times the work of rank 0).
* ``zigzag``: the sequence is cut into 2P chunks of c = N / (2P); rank r holds chunk r then
  chunk 2P-1-r. Every rank does the same causal work. Needs ``N % (2P) == 0``.
* ``striped``: token i lives on rank ``i % P`` (rank r holds r, r+P, r+2P, ...). Equal causal
  work up to one token per row. Needs ``N % P == 0``.
* an explicit :class:`~burstattn.layouts.partition.Partition` (e.g. ``document_partition(cu_seqlens, P)``
  for packed documents): any equal-size, increasing sets of positions. Wherever a layout name is
  accepted (``shard_sequence``, ``gather_sequence``, ``sequence_positions``, ``burst_attn_func``,
  ``attention`` for burst / allgather / ulysses) a partition is too.

In every layout the positions a rank holds are increasing, so a causal mask restricted to
one rank's own tokens is the ordinary lower-triangular mask.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..config import LAYOUTS


DEFAULT_LAYOUT = "zigzag"  # what layout=None means, for every function and strategy


def layout_or_default(layout):
    """``layout``, or :data:`DEFAULT_LAYOUT` for ``None``."""
    return DEFAULT_LAYOUT if layout is None else layout


def check_layout(layout) -> None:
    """Raise ``ValueError`` unless ``layout`` is a known layout name or a
    :class:`~burstattn.layouts.partition.Partition`."""
    if not isinstance(layout, str) and hasattr(layout, "positions_of"):
        return
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def split_error(seq_len: int, world_size: int, layout: str) -> Optional[str]:
    """Why ``seq_len`` tokens cannot be split over ``world_size`` ranks, or ``None`` if they can."""
    parts = 2 * world_size if layout == "zigzag" else world_size
    if seq_len <= 0 or seq_len % parts:
        return (f"sequence length {seq_len} cannot be split by layout {layout!r} over "
                f"{world_size} ranks: it must be a positive multiple of {parts}")
    return None


def local_positions(seq_len: int, rank: int, world_size: int, layout: str) -> torch.Tensor:
    """Global positions held by ``rank``: LongTensor ``[seq_len // world_size]``, increasing.

    Pure function (no process group). Raises ``ValueError`` for an unknown layout or a length
    the layout cannot split.
    """
    check_layout(layout)
    if not isinstance(layout, str):
        if (layout.seq_len, layout.world_size) != (seq_len, world_size):
            raise ValueError(f"the partition is for {layout.world_size} ranks and {layout.seq_len} tokens, "
                             f"not {world_size} ranks and {seq_len} tokens")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        return layout.positions_of(rank)
    err = split_error(seq_len, world_size, layout)
    if err:
        raise ValueError(err)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    n = seq_len // world_size
    if layout == "contiguous":
        return torch.arange(rank * n, (rank + 1) * n)
    if layout == "striped":
        return torch.arange(rank, seq_len, world_size)
    c = n // 2
    far = 2 * world_size - 1 - rank
    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange(far * c, (far + 1) * c)])


def group_info(group: Optional[dist.ProcessGroup], fn: str = "layout") -> tuple[int, int]:
    """``(rank, world size)`` of this process in ``group`` (``(0, 1)`` without torch.distributed).

    Raises:
        ValueError: ``group`` given without torch.distributed, or this process is not in ``group``.
    """
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise ValueError(f"{fn}: group was given but torch.distributed is not initialized")
        return 0, 1
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"{fn}: this process (global rank {dist.get_rank()}) is not a member of group; call it "
                         f"only on the ranks of the group (group ranks -> global: "
                         f"{dist.get_process_group_ranks(group)})")
    return rank, dist.get_world_size(group)


def sequence_positions(seq_len: int, *, group: Optional[dist.ProcessGroup] = None,
                       layout: str = "zigzag") -> torch.Tensor:
    """Global token positions this rank holds: LongTensor ``[seq_len // P]`` (for RoPE, masks)."""
    rank, world = group_info(group, "sequence_positions")
    return local_positions(seq_len, rank, world, layout_or_default(layout))


def _split_dim(x: torch.Tensor, dim: int) -> int:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim {dim} out of range for a tensor with {x.dim()} dimensions")
    return dim % x.dim()


def _shard(x: torch.Tensor, rank: int, world: int, layout, dim: int) -> torch.Tensor:
    seq_len = x.shape[dim]
    check_layout(layout)
    if not isinstance(layout, str):
        return x.index_select(dim, local_positions(seq_len, rank, world, layout).to(x.device))
    err = split_error(seq_len, world, layout)
    if err:
        raise ValueError(err)
    n = seq_len // world
    if layout == "contiguous":
        return x.narrow(dim, rank * n, n)
    if layout == "zigzag":
        c = n // 2
        far = 2 * world - 1 - rank
        return torch.cat([x.narrow(dim, rank * c, c), x.narrow(dim, far * c, c)], dim=dim)
    return x.index_select(dim, local_positions(seq_len, rank, world, layout).to(x.device))


def shard_sequence(x: torch.Tensor, *, group: Optional[dist.ProcessGroup] = None,
                   layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """This rank's shard of a full-sequence tensor.

    Args:
        x: any tensor whose dimension ``dim`` is the full sequence ``N`` (e.g. ``[B, N, H, D]``).
    Returns:
        ``x`` restricted to :func:`sequence_positions` along ``dim`` (size ``N // P``). Differentiable.
    """
    dim = _split_dim(x, dim)
    rank, world = group_info(group, "shard_sequence")
    return _shard(x, rank, world, layout_or_default(layout), dim)


class _GatherSequence(torch.autograd.Function):
    """All-gather of the shards into the full sequence; backward: reduce-scatter (sum), its adjoint."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, layout: str, dim: int) -> torch.Tensor:
        world = dist.get_world_size(group)
        ctx.group, ctx.layout, ctx.dim = group, layout, dim
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x, group=group)
        n = x.shape[dim]
        full = torch.empty(*x.shape[:dim], n * world, *x.shape[dim + 1:], dtype=x.dtype, device=x.device)
        for r, part in enumerate(parts):
            idx = local_positions(n * world, r, world, layout).to(x.device)
            full.index_copy_(dim, idx, part)
        return full

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        world = dist.get_world_size(ctx.group)
        pieces = [_shard(grad, r, world, ctx.layout, ctx.dim).contiguous() for r in range(world)]
        out = torch.empty_like(pieces[0])
        dist.reduce_scatter(out, pieces, group=ctx.group)
        return out, None, None, None


def gather_sequence(x_local: torch.Tensor, *, group: Optional[dist.ProcessGroup] = None,
                    layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's shard (inverse of :func:`shard_sequence`).

    Args:
        x_local: this rank's shard, size ``n`` along ``dim``; equal on every rank.
    Returns:
        The full tensor, size ``n * P`` along ``dim``, on every rank. Differentiable: the
        backward sums the gradients all ranks hand back (reduce-scatter), the adjoint of the
        all-gather, so a loss computed on every rank counts once per rank.
    """
    dim = _split_dim(x_local, dim)
    layout = layout_or_default(layout)
    check_layout(layout)
    _, world = group_info(group, "gather_sequence")
    if world == 1:
        return x_local
    return _GatherSequence.apply(x_local, group, layout, dim)

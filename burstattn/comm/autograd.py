"""Differentiable collectives: :class:`~burstattn.comm.collectives.Collectives` calls whose
backward is the adjoint collective, metered under phase ``"backward"``.

* :func:`all_to_all`: ``[P, ...]`` chunk j to rank j; the adjoint sends every gradient chunk
  back where it came from, which is the same all-to-all.
* :func:`all_gather`: ``[...] -> [P, ...]``; the adjoint is a reduce-scatter (each rank's
  gradient is the sum of what every rank computed for it), summed in float32 (float64 for
  float64 inputs) on the wire and cast back to the input dtype.

The byte meter active in the forward is captured for the backward (used when the backward
runs where no meter is active, e.g. in autograd's thread), as :mod:`burstattn.autograd` does.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..formulas import accum_dtype
from .collectives import Collectives
from .stats import CommStats, active_stats


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, op: str, stats: Optional[CommStats]):
        ctx.group, ctx.op, ctx.stats = group, op, stats
        return Collectives(group, "forward", stats).all_to_all(x, op)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        coll = Collectives(ctx.group, "backward", active_stats() or ctx.stats)
        return coll.all_to_all(grad, ctx.op), None, None, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, op: str, stats: Optional[CommStats]):
        ctx.group, ctx.op, ctx.stats = group, op, stats
        return Collectives(group, "forward", stats).all_gather(x, op)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        coll = Collectives(ctx.group, "backward", active_stats() or ctx.stats)
        summed = coll.reduce_scatter(grad.to(accum_dtype(grad.dtype)), ctx.op)
        return summed.to(grad.dtype), None, None, None


def all_to_all(x: torch.Tensor, group: dist.ProcessGroup, op: str) -> torch.Tensor:
    """Differentiable all-to-all: ``x [P, ...]`` -> ``[P, ...]`` (chunk i from rank i).

    Bytes (op ``op``): ``(P-1)/P`` of ``x`` forward, the same for the gradient backward.
    """
    return _AllToAll.apply(x, group, op, active_stats())


def all_gather(x: torch.Tensor, group: dist.ProcessGroup, op: str) -> torch.Tensor:
    """Differentiable all-gather: ``x [...]`` -> ``[P, ...]`` (entry i from rank i).

    Bytes (op ``op``): ``(P-1)`` times ``x`` forward; backward, a reduce-scatter of the
    ``[P, ...]`` gradient in the accumulator dtype: ``(P-1)`` times ``x``'s element count
    at 4 bytes (8 for float64).
    """
    return _AllGather.apply(x, group, op, active_stats())

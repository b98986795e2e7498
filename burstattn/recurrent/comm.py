"""The recurrences' communication: a metered, differentiable all-gather and the input agreement check.

The all-gather's backward is the reduce-scatter (sum) of the gradients every rank hands back:
its adjoint, so "the state's gradient flows from later chunks" back to the rank that made the
summary. Both directions are metered by :class:`~burstattn.comm.collectives.Collectives` under
the op name given (``"state"`` for recurrent summaries, ``"halo"`` for convolution inputs).
"""
from __future__ import annotations

import zlib
from typing import Optional

import torch
import torch.distributed as dist

from ..comm.collectives import Collectives
from ..comm.stats import active_stats
from ..comm.transport import RingCommError
from ..comm.host import host_side


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group, op: str) -> torch.Tensor:
        ctx.group, ctx.op, ctx.stats = group, op, active_stats()
        return Collectives(group, "forward", ctx.stats).all_gather(x, op)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        stats = active_stats() or ctx.stats
        return Collectives(ctx.group, "backward", stats).reduce_scatter(grad.contiguous(), "d" + ctx.op), None, None


def all_gather(x: torch.Tensor, group, op: str) -> torch.Tensor:
    """``x [...]`` -> ``[P, ...]`` (entry ``i`` from rank ``i``), differentiable and metered."""
    return _AllGather.apply(x, group, op)


def crc(text: str) -> int:
    """31-bit checksum of ``text`` (equal across processes)."""
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


def check_agree(fn: str, fields: dict, problem: Optional[str], group, world: int) -> None:
    """Raise on every rank if any rank found a ``problem`` (``ValueError``) or ``fields`` differ.

    Args:
        fields: name -> int, what must be equal on every rank (shapes, options, checksums).
        problem: this rank's own error message, or ``None``.
    """
    if world == 1:
        if problem:
            raise ValueError(f"{fn}: {problem}")
        return
    names = list(fields)
    # nccl gathers device tensors only
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
    with host_side():  # real (host) tensors in a dry run too: the table is read below
        mine = torch.tensor([int(problem is not None)] + [int(fields[k]) for k in names], dtype=torch.int64,
                            device=device)
        table = mine.repeat(world, 1)  # every row this rank's: a fake process group leaves the buffer as it is
        try:
            Collectives(group, "forward", active_stats()).all_gather(mine, "meta", out=table)
        except RingCommError as e:
            raise RingCommError(f"{fn}: exchanging the input check failed: {e}") from e
        rows = table.tolist()  # [rank][flag, field...]
    if any(row[0] for row in rows):
        # error path only: every rank saw a flag, so every rank enters this exchange
        texts = [None] * world
        dist.all_gather_object(texts, problem, group=group)
        if problem:
            raise ValueError(f"{fn}: {problem}")
        bad = "; ".join(f"rank {r}: {t}" for r, t in enumerate(texts) if t)
        raise ValueError(f"{fn}: invalid arguments on another rank, all ranks abort the call ({bad})")
    for i, name in enumerate(names, start=1):
        col = [row[i] for row in rows]
        if len(set(col)) > 1:
            raise ValueError(f"{fn}: {name} must be the same on every rank of the group, got {col} (rank order)")

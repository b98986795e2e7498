"""The recurrences' communication: metered, differentiable collectives.

* :func:`all_gather`: its backward is the reduce-scatter (sum) of the gradients every rank hands
  back: its adjoint, so "the state's gradient flows from later chunks" back to the rank that made
  the summary. Metered by :class:`~burstattn.comm.collectives.Collectives` under the op name given
  (``"state"`` for recurrent summaries, ``"halo"`` for convolution inputs).
* :func:`exchange`: one round of point-to-point transfers (the prefix scan's); its backward sends
  each received tensor's gradient back to its sender.
* :func:`sum_grad`: identity forward, all-reduce (sum) of the gradient backward: a replicated input
  (the initial state) read on some ranks gets its whole gradient on every rank.

Ordering: a backward that communicates must run in the same order on every rank, whatever else each
rank's graph holds. :func:`exchange` and :func:`sum_grad` thread a scalar *token* through (forward
order in, backward order out): a rank runs the backward of a round only after that of every later
round, so no two ranks wait on each other in different rounds.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm.collectives import Collectives
from ..comm.stats import active_stats
from ..comm.errors import CollectiveError


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


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, token, group, op, recvs, send_peers, *sends):
        ctx.group, ctx.op, ctx.stats = group, op, active_stats()
        ctx.recvs, ctx.send_peers = recvs, send_peers
        ctx.send_shapes = [(s.numel(), s.dtype, s.device) for s in sends]
        out = _p2p(group, "forward", op, ctx.stats, list(zip(send_peers, sends)), [
            (peer, n, sends[0].dtype if sends else token.dtype, token.device) for peer, n in recvs])
        return (token.clone(), *out)

    @staticmethod
    def backward(ctx, dtoken, *drecvs):
        stats = active_stats() or ctx.stats
        grads = [torch.zeros(n, dtype=d.dtype, device=d.device) if d is None else d.contiguous()
                 for (_, n), d in zip(ctx.recvs, drecvs)] if drecvs else []
        dsends = _p2p(ctx.group, "backward", "d" + ctx.op, stats, [(p, g) for (p, _), g in zip(ctx.recvs, grads)],
                      [(peer, n, dt, dev) for peer, (n, dt, dev) in zip(ctx.send_peers, ctx.send_shapes)])
        return (dtoken, None, None, None, None, *dsends)


TAG = 7411  # the scan's messages never match another channel's (the attention's transport tags 1, 2, ...)


def _p2p(group, phase: str, op: str, stats, sends: list, recvs: list) -> list:
    """Post every send ``(peer, flat tensor)`` and receive ``(peer, numel, dtype, device)`` as one
    batch, wait, return the received tensors; meter one record (this rank's bytes each way)."""
    out = [torch.empty(n, dtype=dt, device=dev) for _, n, dt, dev in recvs]
    ops = [dist.P2POp(dist.isend, t, dist.get_global_rank(group, p), group, TAG) for p, t in sends]
    ops += [dist.P2POp(dist.irecv, t, dist.get_global_rank(group, p), group, TAG) for (p, *_), t in zip(recvs, out)]
    if ops:
        try:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        except RuntimeError as e:
            raise CollectiveError(f"rank {dist.get_rank(group)}: {phase} {op!r} exchange with ranks "
                                  f"{sorted({p for p, *_ in sends + recvs})} failed (a rank died, hung past the "
                                  f"process group's timeout, or the link broke): {e}") from e
        if stats is not None:
            stats.record(phase, op, sum(t.numel() * t.element_size() for _, t in sends),
                         sum(t.numel() * t.element_size() for t in out))
    return out


def exchange(token: torch.Tensor, sends: list, recvs: list, group, op: str):
    """One round: send each ``(peer, flat tensor)`` of ``sends``, receive ``(peer, numel)`` of
    ``recvs`` (in the sends' dtype), differentiable. Returns ``(token, received tensors)``.
    Peers are group ranks; at most one message per peer and direction (pack them)."""
    token, *out = _Exchange.apply(token, group, op, tuple(recvs), tuple(p for p, _ in sends),
                                  *[t.contiguous() for _, t in sends])
    return token, out


class _SumGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, token, x, group, op):
        ctx.group, ctx.op, ctx.stats = group, op, active_stats()
        ctx.like = (x.shape, x.dtype, x.device)
        return token.clone(), x.clone()

    @staticmethod
    def backward(ctx, dtoken, dx):
        stats = active_stats() or ctx.stats
        shape, dtype, device = ctx.like
        dx = torch.zeros(shape, dtype=dtype, device=device) if dx is None else dx.contiguous().clone()
        P = dist.get_world_size(ctx.group)
        try:
            dist.all_reduce(dx, group=ctx.group)
        except RuntimeError as e:
            raise CollectiveError(f"rank {dist.get_rank(ctx.group)}: backward {ctx.op!r} all-reduce failed: "
                                  f"{e}") from e
        if stats is not None:  # a ring all-reduce sends 2 (P - 1) / P of the buffer
            n = dx.numel() * dx.element_size() * 2 * (P - 1) // P
            stats.record("backward", "d" + ctx.op, n, n)
        return dtoken, dx, None, None


def sum_grad(token: torch.Tensor, x: torch.Tensor, group, op: str):
    """``(token, x)`` unchanged forward; backward all-reduces ``x``'s gradient over ``group`` (every
    rank gets the sum of every rank's), metered under ``"d" + op``."""
    return _SumGrad.apply(token, x, group, op)


def broadcast(x: torch.Tensor, src: int, group, op: str) -> torch.Tensor:
    """``x`` of group rank ``src`` on every rank (no gradient); metered as ``src`` sending it once
    (a pipelined broadcast forwards each byte once per rank)."""
    out = x.detach().contiguous().clone()
    try:
        dist.broadcast(out, src=dist.get_global_rank(group, src), group=group)
    except RuntimeError as e:
        raise CollectiveError(f"rank {dist.get_rank(group)}: forward {op!r} broadcast failed: {e}") from e
    stats = active_stats()
    if stats is not None:
        n = out.numel() * out.element_size()
        mine = dist.get_rank(group) == src
        stats.record("forward", op, n if mine else 0, 0 if mine else n)
    return out

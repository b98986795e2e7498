"""The single ring loop, and the three passes built on it.

:func:`ring_loop` runs a plan (from :mod:`.schedule`) over a ring: a travelling block moves
one hop per step (double-buffered: the transfer that brings step t+1's block is posted
before step t's compute and waited for after it), and optionally a travelling float32
accumulator follows one step behind (posted after each step's compute, the last hop taking
it home). The passes plug in what travels and what each step computes:

* :func:`forward`: K/V travel; the output and LSE merge locally (float32).
* :func:`backward_kv`: RingAttention's backward: K/V travel, dK/dV partials follow, dQ stays.
* :func:`backward_query`: BurstAttention's backward: Q, dO, LSE and D = rowsum(dO * O)
  travel, dQ partials follow, dK/dV stay.

All tensors use the internal layout ``[B, H, n, D]`` (n = local sequence length).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ..comm.ring import RingComm
from ..formulas import accum_dtype
from ..kernels.base import Kernel
from ..trace import now_ns
from .merge import merge_
from .payload import Field, Packer
from .schedule import BlockOp, MaskKind, StepPlan

Compute = Callable[[StepPlan, torch.Tensor], Optional[list]]
Fold = Callable[[torch.Tensor, list], None]


def op_slices(op: BlockOp) -> Optional[tuple[slice, slice, bool]]:
    """Kernel call for a block op: (query rows, key rows, causal); ``None`` if empty.

    ``STRICT`` (key j visible iff j < i) is the causal kernel on queries ``1..`` and keys
    ``..-1``; query row 0 of such a block sees nothing and is left out.
    """
    if op.mask is MaskKind.STRICT:
        if op.q_stop - op.q_start < 2:
            return None
        return slice(op.q_start + 1, op.q_stop), slice(op.k_start, op.k_stop - 1), True
    return slice(op.q_start, op.q_stop), slice(op.k_start, op.k_stop), op.mask is MaskKind.CAUSAL


def block_grads(kernel: Kernel, ops, dout, q, k, v, out, lse, scale: float):
    """Yield ``(q_rows, k_rows, dq_j, dk_j, dv_j)`` for each non-empty block op: the gradients
    of one block pair given the global ``out`` and ``lse`` of its query rows."""
    for op in ops:
        sl = op_slices(op)
        if sl is None:
            continue
        qs, ks, causal = sl
        yield (qs, ks, *kernel.backward(dout[:, :, qs], q[:, :, qs], k[:, :, ks], v[:, :, ks], out[:, :, qs],
                                        lse[:, :, qs], scale, causal))


def ring_loop(comm: Optional[RingComm], plans: tuple[StepPlan, ...], carry: torch.Tensor,
              channel: str, compute: Compute, acc_channel: Optional[str] = None,
              acc_init: Optional[torch.Tensor] = None, fold: Optional[Fold] = None) -> Optional[torch.Tensor]:
    """Run ``plans`` with ``carry`` (this rank's own travelling block) moving around the ring.

    Args:
        comm: the ring communicator (``None`` only for a world of one).
        carry: packed travelling block, owned by the loop: it is overwritten from step 1 on (pass
            a fresh pack, never a view of a caller's tensor); the second buffer is allocated once, here.
        compute: ``compute(plan, block) -> contributions`` for the step's block.
        acc_channel, acc_init, fold: optional travelling accumulator: ``acc_init`` (zeros, for
            this rank's own block) is where step 0 folds; each later step receives the
            accumulator of the block it holds, folds its contributions into it
            (``fold(acc, contributions)``) and sends it on; after the last step it arrives
            home. Returns this rank's final accumulator (``None`` without one).
    """
    if not isinstance(plans, tuple):  # a two-level plan: the same loop, nested (engine/double.py)
        from .double import double_loop
        return double_loop(comm, plans, carry, channel, compute, acc_channel, acc_init, fold)
    world = len(plans)
    bufs = [carry, torch.empty_like(carry)] if world > 1 else [carry]
    accs = [acc_init, torch.empty_like(acc_init)] if (acc_init is not None and world > 1) else [acc_init]
    trace = comm.trace if comm is not None else None
    for plan in plans:
        t = plan.step
        block = bufs[t % 2]
        if plan.prefetch:
            comm.send_recv(channel, block, bufs[(t + 1) % 2])
            comm.commit(channel, t)
        t0 = now_ns()
        contributions = compute(plan, block)
        if trace is not None:
            trace.record("compute", comm.phase, channel, t, comm.rank, t0, now_ns())
        if acc_channel is not None:
            if t > 0:
                comm.wait(acc_channel, t)
            acc = accs[t % 2]
            fold(acc, contributions)
            if world > 1:
                comm.send_recv(acc_channel, acc, accs[(t + 1) % 2])
                comm.commit(acc_channel, t)
        if plan.prefetch:
            comm.wait(channel, t)
    if acc_channel is None:
        return None
    if world == 1:
        return accs[0]
    comm.wait(acc_channel, world)
    return accs[world % 2]


def world_of(plans) -> int:
    """World size of a flat plan (a tuple of steps) or of a two-level plan."""
    return plans.world_size if hasattr(plans, "world_size") else len(plans)


def _pack_kv(k: torch.Tensor, v: torch.Tensor, world: int):
    """K and V as one travelling buffer ``[2, B, Hkv, n, D]`` (a plain pair in a world of one)."""
    return torch.stack([k, v]) if world > 1 else (k, v)


def forward(comm: Optional[RingComm], plans, kernel: Kernel, q: torch.Tensor, k: torch.Tensor,
            v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Ring forward. ``q [B, Hq, n, D]``, ``k, v [B, Hkv, n, D]`` -> ``out [B, Hq, n, D]``
    and ``lse [B, Hq, n]``, both float32 (float64 for float64 inputs)."""
    b, hq, n, d = q.shape
    acc = accum_dtype(q.dtype)
    state: dict[str, torch.Tensor] = {}  # running "out" [B, Hq, n, D] and "lse" [B, Hq, n]

    def compute(plan: StepPlan, kv) -> None:
        for op in plan.ops:
            sl = op_slices(op)
            if sl is None:
                continue
            qs, ks, causal = sl
            o_j, lse_j = kernel.forward(q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], scale, causal)
            if not state and qs == slice(0, n):  # first partial covers every row: adopt it
                state["out"], state["lse"] = o_j.to(acc), lse_j.to(acc)
                continue
            if not state:
                state["out"] = torch.zeros(b, hq, n, d, dtype=acc, device=q.device)
                state["lse"] = torch.full((b, hq, n), float("-inf"), dtype=acc, device=q.device)
            merge_(state["out"][:, :, qs], state["lse"][:, :, qs], o_j, lse_j)

    ring_loop(comm, plans, _pack_kv(k, v, world_of(plans)), "kv", compute)
    if not state:  # nothing computed (cannot happen with the dense plans: the diagonal is never empty)
        state["out"] = torch.zeros(b, hq, n, d, dtype=acc, device=q.device)
        state["lse"] = torch.full((b, hq, n), float("-inf"), dtype=acc, device=q.device)
    return state["out"], state["lse"]


def backward_kv(comm: Optional[RingComm], plans, kernel: Kernel, dout, q, k, v, out, lse,
                scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """KV-ring backward (RingAttention). Inputs ``[B, H, n, D]`` (``out`` global, q.dtype;
    ``lse [B, Hq, n]`` global). Returns ``dq``, ``dk``, ``dv`` in the accumulator dtype
    (float32; float64 for float64 inputs)."""
    acc = accum_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)

    def compute(plan: StepPlan, kv: torch.Tensor) -> list:
        parts = []
        for qs, ks, dq_j, dk_j, dv_j in block_grads(kernel, plan.ops, dout, q, kv[0], kv[1], out, lse, scale):
            dq[:, :, qs] += dq_j
            parts.append((ks, dk_j, dv_j))
        return parts

    def fold(acc: torch.Tensor, parts: list) -> None:
        for ks, dk_j, dv_j in parts:
            acc[0][:, :, ks] += dk_j
            acc[1][:, :, ks] += dv_j

    acc0 = torch.zeros((2,) + tuple(k.shape), dtype=acc, device=k.device)
    dkv = ring_loop(comm, plans, _pack_kv(k, v, world_of(plans)), "kv", compute, "dkv", acc0, fold)
    return dq, dkv[0], dkv[1]


def _pseudo_out(dout: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """A tensor ``O'`` with ``rowsum(dout * O') == delta``: ``dout * delta / |dout|^2``.

    The fused kernels take the output only to form D = rowsum(dO * O); the query ring ships
    D (one scalar per row) instead of O (head_dim values per row) and rebuilds an
    equivalent O' on arrival. Rows with dO == 0 have D == 0 and get O' == 0.
    """
    df = dout.to(delta.dtype)
    norm = (df * df).sum(-1, keepdim=True)
    scale = torch.where(norm > 0, delta.unsqueeze(-1) / norm, torch.zeros_like(norm))
    return (df * scale).to(dout.dtype)


def backward_query(comm: Optional[RingComm], plans, kernel: Kernel, dout, q, k, v, out, lse,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query-ring backward (BurstAttention). Same inputs/outputs as :func:`backward_kv`."""
    b, hq, n, d = q.shape
    acc = accum_dtype(q.dtype)
    packer = Packer([Field("lse", (b, hq, n), acc), Field("delta", (b, hq, n), acc),
                     Field("q", (b, hq, n, d), q.dtype), Field("dout", (b, hq, n, d), q.dtype)])
    delta = (dout.to(acc) * out.to(acc)).sum(-1)  # D = rowsum(dO * O), [B, Hq, n]
    fields = {"lse": lse, "delta": delta, "q": q, "dout": dout}
    carry = packer.pack(fields, q.device) if world_of(plans) > 1 else None  # a world of one ships nothing
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)

    def compute(plan: StepPlan, payload: torch.Tensor) -> list:
        if not plan.ops:
            return []
        f = packer.views(payload) if payload is not None else fields
        o_s = out if plan.q_rank == plan.k_rank else _pseudo_out(f["dout"], f["delta"])  # own queries: the real O
        parts = []
        for qs, ks, dq_j, dk_j, dv_j in block_grads(kernel, plan.ops, f["dout"], f["q"], k, v, o_s, f["lse"],
                                                    scale):
            dk[:, :, ks] += dk_j
            dv[:, :, ks] += dv_j
            parts.append((qs, dq_j))
        return parts

    def fold(acc: torch.Tensor, parts: list) -> None:
        for qs, dq_j in parts:
            acc[:, :, qs] += dq_j

    acc0 = torch.zeros(q.shape, dtype=acc, device=q.device)
    dq = ring_loop(comm, plans, carry, "q", compute, "dq", acc0, fold)
    return dq, dk, dv

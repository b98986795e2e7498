"""Direct schedules (DistFlashAttn): data goes straight from its owner to the rank that computes
with it, and partial results go straight back; no relaying around a ring.

:func:`direct_loop` runs a :class:`~.schedule.DirectStep` plan. At every step it posts the
transfers that bring the *next* step's data (this rank's own K/V or query side to the ranks
that need them, and theirs to it) before computing the current step, then posts the partial
results of the current step back to their owners, and waits for both after the compute:
the same double-buffered overlap as the ring. Which rank sends what is a pure function of
the plan, so every queued send has its receive queued on the peer in the same step.

All tensors use the internal layout ``[B, H, n, D]``.
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
from .ring import _pseudo_out
from .schedule import DirectStep, block_ops, part_rows


class _Side:
    """One kind of travelling data: this rank's own copy and two receive buffers."""

    def __init__(self, own: Optional[torch.Tensor]) -> None:
        self.own = own
        self.bufs = [torch.empty_like(own), torch.empty_like(own)] if own is not None else []


def direct_loop(comm: Optional[RingComm], plan: tuple[DirectStep, ...], kv: _Side, qs: _Side,
                compute: Callable, ret: Optional[tuple[Callable, Callable, frozenset]] = None) -> None:
    """Run ``plan``; ``compute(step, kv_block, q_block) -> (to_own_k, to_helper_q)`` partials.

    ``kv_block`` is the K/V this rank computes its queries against (its own at step 0),
    ``q_block`` the query side it helps with (or ``None``). ``ret = (alloc, fold, kinds)``:
    partial results of the ``kinds`` (a subset of ``{"kv", "q"}``) go back to their owners on
    channel ``"ret"``: ``alloc(kind)`` gives a receive buffer for a partial about this rank's
    K/V (``"kv"``) or queries (``"q"``), ``fold(kind, buffer)`` adds a received partial.
    """
    rank = comm.rank if comm is not None else 0

    def post_fetch(i: int, st: DirectStep) -> None:
        if comm is None:
            return
        if st.kv_to is not None:
            comm.queue("fetch", "send", kv.own, st.kv_to, "kv")
        if st.own_k is not None and st.own_k != rank:
            comm.queue("fetch", "recv", kv.bufs[i % 2], st.own_k, "kv")
        if st.q_to is not None:
            comm.queue("fetch", "send", qs.own, st.q_to, "q")
        if st.helper_q is not None:
            comm.queue("fetch", "recv", qs.bufs[i % 2], st.helper_q, "q")
        comm.commit("fetch", st.step, allow_empty=True)

    received = []
    for i, st in enumerate(plan):  # buffers alternate by position in the plan (steps may be sparse)
        t = st.step
        if i + 1 < len(plan):
            post_fetch(i + 1, plan[i + 1])
        t0 = now_ns()
        kv_block = None
        if st.own_k is not None:
            kv_block = kv.own if st.own_k == rank else kv.bufs[i % 2]
        q_block = qs.bufs[i % 2] if st.helper_q is not None else None
        to_k, to_q = compute(st, kv_block, q_block)
        if comm is not None and comm.trace is not None:
            comm.trace.record("compute", comm.phase, "fetch", t, comm.rank, t0, now_ns())
        if ret is not None and comm is not None:
            alloc, _, kinds = ret
            received = []
            if to_k is not None and st.own_k != rank:
                comm.queue("ret", "send", to_k, st.own_k, "ret_kv")
            if to_q is not None:
                comm.queue("ret", "send", to_q, st.helper_q, "ret_q")
            if st.kv_to is not None and "kv" in kinds:
                received.append(("kv", alloc("kv")))
                comm.queue("ret", "recv", received[-1][1], st.kv_to, "ret_kv")
            if st.q_to is not None and "q" in kinds:
                received.append(("q", alloc("q")))
                comm.queue("ret", "recv", received[-1][1], st.q_to, "ret_q")
            comm.commit("ret", t, allow_empty=True)
        if comm is not None:
            comm.wait("fetch", t, allow_empty=True)
            comm.wait("ret", t, allow_empty=True)
        if ret is not None:
            for kind, buf in received:
                ret[1](kind, buf)


def _full_or_causal(q_rank: int, k_rank: int, world: int, n: int) -> bool:
    """Whether the pair needs the causal kernel (diagonal) rather than the unmasked one."""
    (op,) = block_ops(q_rank, k_rank, world, "contiguous", True, n)
    return op.mask.value == "causal"


def distflash_forward(comm: Optional[RingComm], plan: tuple[DirectStep, ...], kernel: Kernel,
                      q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DistFlashAttn forward (causal, contiguous). Same tensors as :func:`.ring.forward`."""
    b, hq, n, d = q.shape
    rank, world = (comm.rank, comm.world_size) if comm is not None else (0, 1)
    acc = accum_dtype(q.dtype)
    result = Packer([Field("lse", (b, hq, n), acc), Field("out", (b, hq, n, d), q.dtype)])
    needs_q = any(st.q_to is not None or st.helper_q is not None for st in plan)
    kv = _Side(torch.stack([k, v]) if world > 1 else None)
    qs = _Side(q.contiguous() if needs_q else None)
    state: dict[str, torch.Tensor] = {}

    def fold_partial(o_j: torch.Tensor, lse_j: torch.Tensor) -> None:
        if not state:
            state["out"], state["lse"] = o_j.to(acc), lse_j.to(acc)
        else:
            merge_(state["out"], state["lse"], o_j, lse_j)

    def compute(st: DirectStep, kv_block, q_block):
        to_q = None
        if st.own_k is not None:
            kk, vv = (k, v) if kv_block is None else (kv_block[0], kv_block[1])
            rows = part_rows(st.own_part, n)
            o_j, lse_j = kernel.forward(q[:, :, rows], kk, vv, scale, _full_or_causal(rank, st.own_k, world, n))
            if st.own_part is None:
                fold_partial(o_j, lse_j)
            else:  # half a block (the last step for even P); state exists since step 0
                merge_(state["out"][:, :, rows], state["lse"][:, :, rows], o_j, lse_j)
        if q_block is not None:
            rows = part_rows(st.helper_part, n)
            o_h, lse_h = kernel.forward(q_block[:, :, rows], k, v, scale, False)  # helper: strictly earlier keys
            to_q = result.alloc(q.device)
            f = result.views(to_q)
            if st.helper_part is not None:  # rows not computed here: LSE -inf, ignored by the merge
                f["lse"].fill_(float("-inf"))
                f["out"].zero_()
            f["lse"][:, :, rows] = lse_h
            f["out"][:, :, rows] = o_h
        return None, to_q

    def fold(kind: str, buf: torch.Tensor) -> None:
        f = result.views(buf)
        fold_partial(f["out"], f["lse"])

    direct_loop(comm, plan, kv, qs, compute, (lambda kind: result.alloc(q.device), fold, frozenset({"q"})))
    return state["out"], state["lse"]


def distflash_backward(comm: Optional[RingComm], plan: tuple[DirectStep, ...], kernel: Kernel,
                       dout, q, k, v, out, lse, scale: float):
    """DistFlashAttn backward: own steps receive K/V and return dK/dV partials; helper steps
    receive Q, dO, LSE and D and return dQ partials. Same tensors as :func:`.ring.backward_kv`."""
    b, hq, n, d = q.shape
    rank, world = (comm.rank, comm.world_size) if comm is not None else (0, 1)
    acc = accum_dtype(q.dtype)
    packer = Packer([Field("lse", (b, hq, n), acc), Field("delta", (b, hq, n), acc),
                     Field("q", (b, hq, n, d), q.dtype), Field("dout", (b, hq, n, d), q.dtype)])
    delta = (dout.to(acc) * out.to(acc)).sum(-1)  # D = rowsum(dO * O), [B, Hq, n]
    needs_q = any(st.q_to is not None or st.helper_q is not None for st in plan)
    kv = _Side(torch.stack([k, v]) if world > 1 else None)
    qs = _Side(packer.pack({"lse": lse, "delta": delta, "q": q, "dout": dout}, q.device) if needs_q else None)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dkv = torch.zeros((2,) + tuple(k.shape), dtype=acc, device=k.device)

    def compute(st: DirectStep, kv_block, q_block):
        to_k = to_q = None
        if st.own_k is not None:
            kk, vv = (k, v) if kv_block is None else (kv_block[0], kv_block[1])
            rows = part_rows(st.own_part, n)
            dq_j, dk_j, dv_j = kernel.backward(dout[:, :, rows], q[:, :, rows], kk, vv, out[:, :, rows],
                                               lse[:, :, rows], scale, _full_or_causal(rank, st.own_k, world, n))
            dq[:, :, rows] += dq_j
            if st.own_k == rank:
                dkv[0].add_(dk_j)
                dkv[1].add_(dv_j)
            else:
                to_k = torch.stack([dk_j.to(acc), dv_j.to(acc)])
        if q_block is not None:
            f = {name: x[:, :, part_rows(st.helper_part, n)] for name, x in packer.views(q_block).items()}
            dq_j, dk_j, dv_j = kernel.backward(f["dout"], f["q"], k, v, _pseudo_out(f["dout"], f["delta"]),
                                               f["lse"], scale, False)
            dkv[0].add_(dk_j)
            dkv[1].add_(dv_j)
            to_q = torch.zeros_like(dq)
            to_q[:, :, part_rows(st.helper_part, n)] = dq_j
        return to_k, to_q

    def alloc(kind: str) -> torch.Tensor:
        return torch.empty_like(dkv) if kind == "kv" else torch.empty_like(dq)

    def fold(kind: str, buf: torch.Tensor) -> None:
        (dkv if kind == "kv" else dq).add_(buf)

    direct_loop(comm, plan, kv, qs, compute, (alloc, fold, frozenset({"kv", "q"})))
    return dq, dkv[0], dkv[1]

"""Masked attention passes over the sparse direct schedules of :mod:`burstattn.masks.plan`.

Same contract as the ring passes (:mod:`.ring`): tensors ``[B, H, n, D]``, outputs in the
accumulator dtype. Only the block ops of the mask summary are computed (full blocks with the
unmasked kernel, diagonal blocks with its causal mode, partial blocks with an explicit mask),
and K/V (or queries) go only to the ranks that need them (:func:`.direct.direct_loop`).

Rows that see no key anywhere get output 0 and LSE ``-inf``; in the backward their LSE is
replaced by a huge finite value (``1e30``) so that every kernel computes ``P = exp(s - lse) = 0``
for them (zero gradients, never NaN; finite, so that no fused kernel forms ``inf - inf``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..comm.ring import RingComm
from ..formulas import accum_dtype
from ..kernels.base import Kernel
from ..layout import local_positions
from ..masks.blocks import op_mask
from ..masks.plan import MaskPlan
from ..masks.spec import AttnMask
from .direct import _Side, direct_loop
from .merge import merge_
from .payload import Field, Packer
from .ring import _pseudo_out, op_slices
from .schedule import BlockOp, MaskKind


@dataclass
class MaskedCall:
    """Everything a masked pass needs besides the tensors.

    Attributes:
        kernel: the local kernel; ``fallback`` runs the PARTIAL ops when ``kernel`` takes no
            explicit mask (flash-attn -> sdpa).
    """

    mask: AttnMask
    causal: bool
    seq_len: int
    layout: object
    plan: MaskPlan
    kernel: Kernel
    fallback: Kernel
    scale: float

    def pos(self, rank: int) -> torch.Tensor:
        return local_positions(self.seq_len, rank, self.plan.world_size, self.layout)

    def call(self, op: BlockOp, q_rank: int, k_rank: int, device):
        """``(q rows, k rows, causal, kernel, mask)`` of one op, ``None`` if it computes nothing:
        FULL / CAUSAL / STRICT run the kernel's own modes, PARTIAL an explicit bool mask block."""
        if op.mask is not MaskKind.PARTIAL:
            sl = op_slices(op)
            return None if sl is None else (*sl, self.kernel, None)
        m = op_mask(self.mask, self.causal, self.seq_len, self.pos(q_rank), self.pos(k_rank), op).to(device)
        return (slice(op.q_start, op.q_stop), slice(op.k_start, op.k_stop), False,
                self.kernel if self.kernel.supports_mask else self.fallback, m)

    def forward_op(self, op: BlockOp, q, k, v, q_rank: int, k_rank: int):
        """``(q rows, out_j, lse_j)`` of one op (``None`` if it computes nothing)."""
        c = self.call(op, q_rank, k_rank, q.device)
        if c is None:
            return None
        qs, ks, causal, kern, m = c
        o_j, lse_j = kern.forward(q[:, :, qs], k[:, :, ks], v[:, :, ks], self.scale, causal, mask=m)
        if m is not None:
            blind = ~m.any(1)  # rows of this block that see none of its keys
            if bool(blind.any()):
                lse_j = lse_j.masked_fill(blind, float("-inf"))
                o_j = o_j.masked_fill(blind[:, None], 0.0)
        return qs, o_j, lse_j

    def backward_ops(self, ops, dout, q, k, v, out, lse, q_rank: int, k_rank: int):
        """Yield ``(q rows, k rows, dq_j, dk_j, dv_j)`` per op (``lse``: huge for blind rows)."""
        for op in ops:
            c = self.call(op, q_rank, k_rank, q.device)
            if c is None:
                continue
            qs, ks, causal, kern, m = c
            yield (qs, ks, *kern.backward(dout[:, :, qs], q[:, :, qs], k[:, :, ks], v[:, :, ks], out[:, :, qs],
                                          lse[:, :, qs], self.scale, causal, mask=m))


def _kv_side(comm: Optional[RingComm], steps, k, v) -> _Side:
    """This rank's K/V packed for sending (nothing when the plan never moves K/V)."""
    return _Side(torch.stack([k, v]) if comm is not None and len(steps) > 1 else None)


def masked_forward(comm: Optional[RingComm], call: MaskedCall, q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [B, Hq, n, D]``, ``k, v [B, Hkv, n, D]`` -> ``out [B, Hq, n, D]``, ``lse [B, Hq, n]``
    (accumulator dtype; rows that see nothing: 0 and -inf)."""
    b, hq, n, d = q.shape
    acc = accum_dtype(q.dtype)
    rank = call.plan.rank
    out = torch.zeros(b, hq, n, d, dtype=acc, device=q.device)
    lse = torch.full((b, hq, n), float("-inf"), dtype=acc, device=q.device)

    def compute(st, kv_block, q_block):
        if st.own_k is not None:
            kk, vv = (k, v) if st.own_k == rank else (kv_block[0], kv_block[1])
            for op in call.plan.row[st.own_k]:
                res = call.forward_op(op, q, kk, vv, rank, st.own_k)
                if res is not None:
                    qs, o_j, lse_j = res
                    merge_(out[:, :, qs], lse[:, :, qs], o_j, lse_j)
        return None, None

    steps = call.plan.kv_steps()
    direct_loop(comm, steps, _kv_side(comm, steps, k, v), _Side(None), compute)
    return out, lse


BLIND_LSE = 1e30  # exp(s - 1e30) == 0 in float32 and float64; finite, so no kernel forms inf - inf


def backward_lse(lse: torch.Tensor) -> torch.Tensor:
    """Global LSE with ``-inf`` (rows that see nothing) replaced by a huge finite value: P = 0 there."""
    return lse.masked_fill(lse == float("-inf"), BLIND_LSE)


def masked_backward_kv(comm: Optional[RingComm], call: MaskedCall, dout, q, k, v, out, lse):
    """K/V go to the ranks that need them again; dK/dV partials return to their owners.
    Returns ``dq, dk, dv`` in the accumulator dtype."""
    acc = accum_dtype(q.dtype)
    rank, lse_b = call.plan.rank, backward_lse(lse)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dkv = torch.zeros((2,) + tuple(k.shape), dtype=acc, device=k.device)

    def compute(st, kv_block, q_block):
        if st.own_k is None:
            return None, None
        own = st.own_k == rank
        kk, vv = (k, v) if own else (kv_block[0], kv_block[1])
        target = dkv if own else torch.zeros_like(dkv)
        for qs, ks, dq_j, dk_j, dv_j in call.backward_ops(call.plan.row[st.own_k], dout, q, kk, vv, out, lse_b,
                                                          rank, st.own_k):
            dq[:, :, qs] += dq_j
            target[0][:, :, ks] += dk_j
            target[1][:, :, ks] += dv_j
        return (None if own else target), None

    steps = call.plan.kv_steps()
    direct_loop(comm, steps, _kv_side(comm, steps, k, v), _Side(None), compute,
                (lambda kind: torch.empty_like(dkv), lambda kind, buf: dkv.add_(buf), frozenset({"kv"})))
    return dq, dkv[0], dkv[1]


def masked_backward_query(comm: Optional[RingComm], call: MaskedCall, dout, q, k, v, out, lse):
    """Queries (Q, dO, LSE, D) go to the ranks whose keys they see; dQ partials return.
    Returns ``dq, dk, dv`` in the accumulator dtype."""
    b, hq, n, d = q.shape
    acc = accum_dtype(q.dtype)
    rank, lse_b = call.plan.rank, backward_lse(lse)
    packer = Packer([Field("lse", (b, hq, n), acc), Field("delta", (b, hq, n), acc),
                     Field("q", (b, hq, n, d), q.dtype), Field("dout", (b, hq, n, d), q.dtype)])
    steps = call.plan.q_steps()
    travels = comm is not None and len(steps) > 1
    delta = (dout.to(acc) * out.to(acc)).sum(-1)  # D = rowsum(dO * O), [B, Hq, n]
    qside = _Side(packer.pack({"lse": lse_b, "delta": delta, "q": q, "dout": dout}, q.device) if travels else None)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)

    def compute(st, kv_block, q_block):
        to_q = None
        if st.own_k is not None:  # step 0: own queries x own keys
            for qs, ks, dq_j, dk_j, dv_j in call.backward_ops(call.plan.row[rank], dout, q, k, v, out, lse_b,
                                                              rank, rank):
                dq[:, :, qs] += dq_j
                dk[:, :, ks] += dk_j
                dv[:, :, ks] += dv_j
        if q_block is not None:
            f = packer.views(q_block)
            to_q = torch.zeros_like(dq)
            for qs, ks, dq_j, dk_j, dv_j in call.backward_ops(
                    call.plan.col[st.helper_q], f["dout"], f["q"], k, v, _pseudo_out(f["dout"], f["delta"]),
                    f["lse"], st.helper_q, rank):
                to_q[:, :, qs] += dq_j
                dk[:, :, ks] += dk_j
                dv[:, :, ks] += dv_j
        return None, to_q

    direct_loop(comm, steps, _Side(None), qside, compute,
                (lambda kind: torch.empty_like(dq), lambda kind, buf: dq.add_(buf), frozenset({"q"})))
    return dq, dk, dv

"""Bytes each rank sends per call, by formula (the figures ``comm_stats()`` must reproduce).

Notation: P ranks, n local tokens, B batch, Hq/Hkv query/kv heads, d head_dim, e the
element size of the input dtype, a that of the accumulators (4: float32; 8 for float64
inputs). Per rank, one call:

* forward (K/V ring): ``(P-1) * 2*B*n*Hkv*d * e``            (op ``kv``)
* backward ``"kv"`` (RingAttention): K/V again ``(P-1) * 2*B*n*Hkv*d * e`` (op ``kv``)
  plus the dK/dV accumulator ``P * 2*B*n*Hkv*d * a`` (op ``dkv``: P-1 hops and the
  hop home).
* backward ``"burst"`` (query ring): Q, dO, lse, D ``(P-1) * B*n*Hq*(2*d*e + 2*a)`` (op ``q``)
  plus the dQ accumulator ``P * B*n*Hq*d * a`` (op ``dq``).
* input validation: the cross-rank check's one all-gather of ``META_INTS`` int64 per rank (op ``meta``,
  forward; :data:`burstattn.comm.agree.DIGEST_INTS`), counted as ``(P-1) * 8 * META_INTS`` bytes sent.

The other strategies' formulas are ``bytes_formula`` in their modules under
:mod:`burstattn.strategies` (``STRATEGIES[name].bytes_formula()``), built with
:func:`byte_totals` into the same shape as :func:`ring_bytes`.

With N = n*P: burst moves about ``3*N*Hq*d`` elements in the backward against the KV ring's
``4*N*Hkv*d``, so for multi-head attention burst sends less (and 16-bit K/V with float32
dK/dV make the KV ring dearer still); with GQA (Hq/Hkv >= 2) the KV ring sends less.
"""
from __future__ import annotations

import torch

from ..comm.agree import DIGEST_INTS
from ..config import accum_dtype

META_INTS = DIGEST_INTS  # the cross-rank check's digest: int64 per rank


def element_size(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return torch.empty((), dtype=dtype).element_size()


def kv_elements(batch: int, local_seq: int, kv_heads: int, head_dim: int, kv_local_seq=None,
                v_head_dim=None) -> int:
    """Elements of one travelling K/V block: ``B*n_k*Hkv*(d + d_v)`` (K and V at their own head sizes;
    ``n_k`` the key shard's length, default ``local_seq``; ``d_v`` default ``head_dim``)."""
    nk = local_seq if kv_local_seq is None else kv_local_seq
    return batch * nk * kv_heads * (head_dim + (head_dim if v_head_dim is None else v_head_dim))


def ring_bytes(*, batch: int, local_seq: int, world_size: int, q_heads: int, kv_heads: int,
               head_dim: int, dtype: torch.dtype, backward: str, kv_local_seq=None, v_head_dim=None) -> dict:
    """Bytes sent per rank: ``{"forward": int, "backward": int, "ops": {(phase, op): int}}``.

    ``backward`` is ``"burst"`` or ``"kv"``. The forward includes the ``meta`` validation bytes.
    ``kv_local_seq`` (cross-attention, a key shard of its own length) and ``v_head_dim`` (MLA): K/V
    blocks are ``B*n_k*Hkv*(d + d_v)`` elements, the query side ``B*n*Hq*((d + d_v)*e + 2*a)`` bytes
    (Q, dO, LSE, D) and the dQ accumulator ``B*n*Hq*d*a``.
    """
    p, e, a = world_size, element_size(dtype), element_size(accum_dtype(dtype))
    dv = head_dim if v_head_dim is None else v_head_dim
    kv_block = kv_elements(batch, local_seq, kv_heads, head_dim, kv_local_seq, v_head_dim)
    q_rows = batch * local_seq * q_heads
    ops = {("forward", "kv"): (p - 1) * kv_block * e,
           ("forward", "meta"): (p - 1) * META_INTS * 8}
    if backward == "kv":
        ops[("backward", "kv")] = (p - 1) * kv_block * e
        ops[("backward", "dkv")] = p * kv_block * a
    elif backward == "burst":
        ops[("backward", "q")] = (p - 1) * q_rows * ((head_dim + dv) * e + 2 * a)
        ops[("backward", "dq")] = p * q_rows * head_dim * a
    else:
        raise ValueError(f"backward must be 'burst' or 'kv', got {backward!r}")
    if p == 1:
        ops = {key: 0 for key in ops}
    return byte_totals(ops)


def meta_bytes(world_size: int) -> int:
    """Bytes one rank sends for the input-validation all-gather (op ``meta``, forward)."""
    return (world_size - 1) * META_INTS * 8


def byte_totals(*parts: dict) -> dict:
    """``{"forward": int, "backward": int, "ops": {(phase, op): int}}`` from one or more
    ``{(phase, op): bytes}`` dicts (summed where keys repeat): the shape of every byte formula."""
    ops: dict = {}
    for part in parts:
        for key, nbytes in part.items():
            ops[key] = ops.get(key, 0) + nbytes
    fwd = sum(v for (ph, _), v in ops.items() if ph == "forward")
    bwd = sum(v for (ph, _), v in ops.items() if ph == "backward")
    return {"forward": fwd, "backward": bwd, "ops": ops}


def choose_backward(*, batch: int, local_seq: int, world_size: int, q_heads: int, kv_heads: int,
                    head_dim: int, dtype: torch.dtype, kv_local_seq=None, v_head_dim=None) -> str:
    """``"burst"`` or ``"kv"``: whichever backward sends fewer bytes (ties go to burst)."""
    kw = dict(batch=batch, local_seq=local_seq, world_size=world_size, q_heads=q_heads,
              kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, kv_local_seq=kv_local_seq, v_head_dim=v_head_dim)
    burst = ring_bytes(backward="burst", **kw)["backward"]
    kv = ring_bytes(backward="kv", **kw)["backward"]
    return "burst" if burst <= kv else "kv"


def distflash_bytes(*, rank: int, batch: int, local_seq: int, world_size: int, q_heads: int,
                    kv_heads: int, head_dim: int, dtype: torch.dtype, v_head_dim=None) -> dict:
    """Bytes ``rank`` sends under ``schedule="distflash"`` (they differ between ranks).

    Per send of this rank's plan (:func:`burstattn.engine.direct.distflash_steps` as a
    :class:`~burstattn.engine.plan.Plan`): its K/V to the rank that computes with them cost
    ``2*B*n*Hkv*d*e`` (op ``kv``, forward and backward); its queries to a helper ``B*n*Hq*d*e`` in the
    forward and ``B*n*Hq*(2*d*e + 2*a)`` (Q, dO, LSE, D) in the backward (op ``q``); a helper returns
    ``B*n*Hq*(d*e + a)`` (output, LSE; op ``ret_q``) in the forward and the dQ partial ``B*n*Hq*d*a``
    in the backward; a rank that computed with another's K/V returns ``2*B*n*Hkv*d*a`` (dK, dV; op
    ``ret_kv``, backward only: the forward has no K/V accumulator). With V's own head size ``d_v``:
    ``2*d`` becomes ``d + d_v`` for K/V and for Q + dO, and the returned output has ``d_v``.
    """
    from .direct import direct, distflash_steps  # the plan that runs says what is sent
    e, a = element_size(dtype), element_size(accum_dtype(dtype))
    dv = head_dim if v_head_dim is None else v_head_dim
    kv = kv_elements(batch, local_seq, kv_heads, head_dim, None, v_head_dim)
    rows = batch * local_seq * q_heads
    size = {("forward", "data", "kv"): kv * e, ("backward", "data", "kv"): kv * e,
            ("forward", "data", "q"): rows * head_dim * e, ("backward", "data", "q"): rows * ((head_dim + dv) * e + 2 * a),
            ("forward", "acc", "q"): rows * (dv * e + a), ("backward", "acc", "q"): rows * head_dim * a,
            ("backward", "acc", "kv"): kv * a}
    plan = direct(rank, distflash_steps(rank, world_size), world_size, lambda q, k: (), local_seq)
    ops = {("forward", "meta"): (world_size - 1) * META_INTS * 8}
    for st in plan.steps:
        for kind, moves in (("data", st.fetch), ("acc", st.give)):
            for mv in moves:
                for phase in ("forward", "backward"):
                    nbytes = size.get((phase, kind, mv.side)) if mv.send else None
                    if nbytes:
                        label = (plan.channels.data if kind == "data" else plan.channels.acc)(mv.side)
                        ops[(phase, label)] = ops.get((phase, label), 0) + nbytes
    return byte_totals(ops)


def double_bytes(*, batch: int, local_seq: int, world_size: int, ranks_per_node: int, q_heads: int,
                 kv_heads: int, head_dim: int, dtype: torch.dtype, backward: str, kv_local_seq=None,
                 v_head_dim=None) -> dict:
    """Bytes each rank sends under ``schedule="double"`` (:func:`burstattn.engine.plan.two_level`), ops named
    by channel: inside nodes ``kv`` / ``q`` and the accumulators ``dkv`` / ``dq``; across nodes the
    same with ``_outer``. R ranks per node, M = P / R nodes: travelling blocks ``(R-1)*M`` inside and
    ``M-1`` across; accumulators ``R*M`` inside (R > 1) and ``M`` across (M > 1)."""
    r, m = ranks_per_node, world_size // ranks_per_node
    e, a = element_size(dtype), element_size(accum_dtype(dtype))
    dv = head_dim if v_head_dim is None else v_head_dim
    kv_block = kv_elements(batch, local_seq, kv_heads, head_dim, kv_local_seq, v_head_dim)
    rows = batch * local_seq * q_heads
    inner_hops, outer_hops = (r - 1) * m, m - 1
    inner_acc, outer_acc = (r * m if r > 1 else 0), (m if m > 1 else 0)
    ops = {("forward", "kv"): inner_hops * kv_block * e, ("forward", "kv_outer"): outer_hops * kv_block * e,
           ("forward", "meta"): (world_size - 1) * META_INTS * 8}
    if backward == "kv":
        ops.update({("backward", "kv"): inner_hops * kv_block * e, ("backward", "kv_outer"): outer_hops * kv_block * e,
                    ("backward", "dkv"): inner_acc * kv_block * a, ("backward", "dkv_outer"): outer_acc * kv_block * a})
    elif backward == "burst":
        pack = rows * ((head_dim + dv) * e + 2 * a)
        ops.update({("backward", "q"): inner_hops * pack, ("backward", "q_outer"): outer_hops * pack,
                    ("backward", "dq"): inner_acc * rows * head_dim * a,
                    ("backward", "dq_outer"): outer_acc * rows * head_dim * a})
    else:
        raise ValueError(f"backward must be 'burst' or 'kv', got {backward!r}")
    if world_size == 1:
        ops = {key: 0 for key in ops}
    return byte_totals(ops)

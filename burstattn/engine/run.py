"""Entry points of the engine: one distributed attention forward / backward on flash-layout tensors.

``attention_forward`` and ``attention_backward`` take this rank's ``[B, n, H, D]`` shards as the
caller has them, build the plan (:func:`build_plan`) once per call and run the one loop
(:func:`.loop.run_plan`) with the pass (:mod:`.passes`) for each *head group* in turn.

Head groups bound the memory: everything a pass allocates (the ``[B, h, n, D]`` contiguous copies
the kernels want, the travelling blocks and their receive buffers, the float32 accumulators, the
kernel's per-block outputs) scales with the group's ``h = H / G`` heads, while only the inputs,
the output and the gradients are whole. :func:`head_groups` picks ``G`` (a divisor of the kv heads)
so that a group still holds at least :data:`MIN_GROUP_ELEMENTS` query elements: small calls stay one
group (one message per hop), long sequences get up to ``Hkv`` groups. Bytes sent do not change.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..formulas import accum_dtype
from ..kernels.base import row_dot
from .loop import Nested, run_plan
from .merge import add_sinks_, sinks_grad
from .passes import BackwardAccs, BlockCalls, ForwardAccs, KVPack, backward_compute, backward_lse, forward_compute
from .plan import DIRECT_LABELS, Plan, direct, ops_from_positions, ring
from .schedule import distflash_plan

MIN_GROUP_ELEMENTS = 1 << 19  # 2 MiB of float32 queries per group (1 MiB bfloat16)
OUTER_LABELS = {("data", "kv"): "kv_outer", ("data", "q"): "q_outer", ("acc", "kv"): "dkv_outer",
                ("acc", "q"): "dq_outer"}


def head_groups(batch: int, local_seq: int, q_heads: int, kv_heads: int, head_dim: int) -> int:
    """The number of head groups: the largest divisor G of ``kv_heads`` with at least
    :data:`MIN_GROUP_ELEMENTS` query elements (``batch * local_seq * q_heads / G * head_dim``) per group."""
    best = 1
    for g in range(1, kv_heads + 1):
        if kv_heads % g == 0 and batch * local_seq * (q_heads // g) * head_dim >= MIN_GROUP_ELEMENTS:
            best = g
    return best


def build_plan(rank: int, world_size: int, *, positions: list, causal: bool, travelling: str,
               schedule: str = "ring", ranks_per_node: int = 1, mask_plan=None, kv_positions: Optional[list] = None):
    """This rank's plan for one pass; ``positions[r]``: the global positions of rank r's queries
    (``[n_r]``; in the keys' coordinates when the two sequences differ, see
    :meth:`burstattn.AttnMask.aligned`) and ``kv_positions[r]`` of its keys (default: the same).
    ``travelling``: ``"kv"`` (forward, RingAttention's backward) or ``"q"`` (BurstAttention's
    backward). ``mask_plan``: a :class:`~burstattn.masks.plan.MaskPlan` (its sparse direct steps and
    block ops replace the dense ones)."""
    n = int(positions[rank].numel())
    kv_positions = positions if kv_positions is None else kv_positions
    if mask_plan is not None:
        mp = mask_plan

        def ops_of(q: int, k: int):
            return mp.row[k] if q == rank else mp.col[q]
        steps = mp.kv_steps() if travelling == "kv" else mp.q_steps()
        return direct(rank, steps, world_size, ops_of, n, DIRECT_LABELS)
    ops_of = ops_from_positions(positions, kv_positions, causal)
    if schedule == "distflash":
        return direct(rank, distflash_plan(rank, world_size), world_size, ops_of, n, DIRECT_LABELS)
    if schedule == "double" and world_size > 1:
        return double_nested(rank, world_size, ranks_per_node, ops_of, travelling)
    return ring(rank, world_size, ops_of, travelling)


def double_nested(rank: int, world_size: int, ranks_per_node: int, ops_of, travelling: str) -> Nested:
    """The two-level ring (:mod:`.double`) as a nested plan: the outer ring over the ranks with this
    rank's index on every node, whose step d runs an inner ring over the node on the outer blocks."""
    r_, m_ = ranks_per_node, world_size // ranks_per_node
    m, i = divmod(rank, r_)
    outer = ring(m, m_, lambda q, k: (), travelling, owners=[o * r_ + i for o in range(m_)], home=rank,
                 labels=OUTER_LABELS)
    inner = tuple(ring(i, r_, ops_of, travelling, owners=[((m - d) % m_) * r_ + j for j in range(r_)], home=rank)
                  for d in range(m_))
    return Nested(outer, inner)


def _own(plan) -> dict:
    return dict((plan.outer if isinstance(plan, Nested) else plan).own)


def _heads(g: int, groups: int, hq: int, hkv: int) -> tuple[slice, slice]:
    return slice(g * hq // groups, (g + 1) * hq // groups), slice(g * hkv // groups, (g + 1) * hkv // groups)


def _bhnd(x: torch.Tensor, heads: slice, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``[B, n, H, D]`` -> the ``heads`` as a contiguous ``[B, h, n, D]`` copy (in ``dtype``)."""
    y = x[:, :, heads].transpose(1, 2)
    return y.to(dtype).contiguous() if dtype is not None else y.contiguous()


def _kv_pack(k: torch.Tensor, v: torch.Tensor, heads: slice) -> tuple[torch.Tensor, KVPack]:
    """``k [B, n, Hkv, D]``, ``v [B, n, Hkv, Dv]`` -> one message (one copy; K and V travel together,
    each at its own head size) and its :class:`KVPack`."""
    kh, vh = k[:, :, heads].transpose(1, 2), v[:, :, heads].transpose(1, 2)  # [B, h, n, D] views
    pack = KVPack(tuple(kh.shape), tuple(vh.shape))
    return pack.pack(kh, vh), pack


def attention_forward(comm, plan, calls: BlockCalls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      groups: int = 1, sinks: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [B, n, Hq, D]``, ``k [B, n_k, Hkv, D]``, ``v [B, n_k, Hkv, Dv]`` -> ``out [B, n, Hq, Dv]``
    (q's dtype, contiguous) and ``lse [B, Hq, n]`` (float32; float64 for float64 inputs; ``-inf`` for
    rows that see nothing). ``sinks [Hq]``: attention-sink logits, added once after the last merge
    (:func:`~.merge.add_sinks_`), so ``lse`` includes them."""
    b, n, hq, d = q.shape
    hkv, dv, acc = k.shape[2], v.shape[3], accum_dtype(q.dtype)
    own = _own(plan)
    out = torch.empty(b, n, hq, dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, hq, n, dtype=acc, device=q.device)
    for g in range(groups):
        hs, ks = _heads(g, groups, hq, hkv)
        kv, pack = _kv_pack(k, v, ks)
        data = {("q", own["q"]): (_bhnd(q, hs),), ("kv", own["kv"]): (kv,)}
        accs = ForwardAccs(data[("q", own["q"])][0], dv)
        del kv
        res = run_plan(comm, plan, data, forward_compute(calls.heads(hs), pack.split), accs).get(("q", own["q"]))
        o, l = res if res is not None else accs.empty()
        if sinks is not None:
            add_sinks_(o, l, sinks[hs])
        out[:, :, hs] = o.transpose(1, 2)
        lse[:, hs] = l
    return out, lse


def attention_backward(comm, plan, calls: BlockCalls, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, groups: int = 1,
                       sinks: Optional[torch.Tensor] = None):
    """Gradients for :func:`attention_forward`'s inputs: ``dq, dk, dv`` (shapes and dtypes of q, k, v)
    and ``dsinks [Hq]`` (float32; ``None`` without sinks: this rank's rows' share, summed over the
    group like any replicated parameter's gradient).

    Per head group the query side is ``(q, dO, [LSE; D])`` with ``D = rowsum(dO * O)``; the pass
    accumulates dQ and dK/dV in float32 and writes them into the outputs."""
    b, n, hq, d = q.shape
    hkv, acc = k.shape[2], accum_dtype(q.dtype)
    own = _own(plan)
    dq, dk, dv = (torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v))
    dsinks = None if sinks is None else torch.zeros(hq, dtype=acc, device=q.device)
    for g in range(groups):
        hs, ks = _heads(g, groups, hq, hkv)
        qh, doh, oh = _bhnd(q, hs), _bhnd(dout, hs, q.dtype), _bhnd(out, hs)
        delta = row_dot(doh, oh, acc)  # D = rowsum(dO * O), [B, h, n]
        if sinks is not None:
            dsinks[hs] = sinks_grad(lse[:, hs], delta, sinks[hs])
        ld = torch.stack([backward_lse(lse[:, hs]), delta])  # [2, B, h, n]
        kv, pack = _kv_pack(k, v, ks)
        accs = BackwardAccs(qh, *pack.split(kv))
        data = {("q", own["q"]): (qh, doh, ld), ("kv", own["kv"]): (kv,)}
        del qh, doh, ld, kv, delta
        res = run_plan(comm, plan, data, backward_compute(calls.heads(hs), own["q"], oh, pack.split), accs)
        del oh
        dq_g = res.get(("q", own["q"])) or accs.zeros("q")
        dkv_g = res.get(("kv", own["kv"])) or accs.zeros("kv")
        dq[:, :, hs] = dq_g[0].transpose(1, 2)
        dk[:, :, ks] = dkv_g[0].transpose(1, 2)
        dv[:, :, ks] = dkv_g[1].transpose(1, 2)
    return dq, dk, dv, dsinks

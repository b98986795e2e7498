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
from .loop import Nested, run_plan
from .passes import BackwardAccs, BlockCalls, ForwardAccs, backward_compute, backward_lse, forward_compute, row_dot
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
               schedule: str = "ring", ranks_per_node: int = 1, mask_plan=None):
    """This rank's plan for one pass; ``positions[r]``: the global positions of rank r's queries
    and keys (``[n_r]``). ``travelling``: ``"kv"`` (forward, RingAttention's backward) or ``"q"``
    (BurstAttention's backward). ``mask_plan``: a :class:`~burstattn.masks.plan.MaskPlan` (its
    sparse direct steps and block ops replace the dense ones)."""
    n = int(positions[rank].numel())
    if mask_plan is not None:
        mp = mask_plan

        def ops_of(q: int, k: int):
            return mp.row[k] if q == rank else mp.col[q]
        steps = mp.kv_steps() if travelling == "kv" else mp.q_steps()
        return direct(rank, steps, world_size, ops_of, n, DIRECT_LABELS)
    ops_of = ops_from_positions(positions, positions, causal)
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


def _kv_pack(k: torch.Tensor, v: torch.Tensor, heads: slice) -> torch.Tensor:
    """``k, v [B, n, Hkv, D]`` -> ``[2, B, h, n, D]`` (one copy; K and V travel as one message)."""
    return torch.stack([k[:, :, heads].transpose(1, 2), v[:, :, heads].transpose(1, 2)])


def attention_forward(comm, plan, calls: BlockCalls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [B, n, Hq, D]``, ``k, v [B, n, Hkv, D]`` -> ``out [B, n, Hq, D]`` (q's dtype, contiguous)
    and ``lse [B, Hq, n]`` (float32; float64 for float64 inputs; ``-inf`` for rows that see nothing)."""
    b, n, hq, d = q.shape
    hkv, acc = k.shape[2], accum_dtype(q.dtype)
    own = _own(plan)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(b, hq, n, dtype=acc, device=q.device)
    for g in range(groups):
        hs, ks = _heads(g, groups, hq, hkv)
        data = {("q", own["q"]): (_bhnd(q, hs),), ("kv", own["kv"]): (_kv_pack(k, v, ks),)}
        accs = ForwardAccs(data[("q", own["q"])][0])
        res = run_plan(comm, plan, data, forward_compute(calls), accs).get(("q", own["q"]))
        o, l = res if res is not None else accs.empty()
        out[:, :, hs] = o.transpose(1, 2)
        lse[:, hs] = l
    return out, lse


def attention_backward(comm, plan, calls: BlockCalls, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                       groups: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients for :func:`attention_forward`'s inputs (same shapes and dtypes as q, k, v).

    Per head group the query side is ``(q, dO, [LSE; D])`` with ``D = rowsum(dO * O)``; the pass
    accumulates dQ and dK/dV in float32 and writes them into the outputs."""
    b, n, hq, d = q.shape
    hkv, acc = k.shape[2], accum_dtype(q.dtype)
    own = _own(plan)
    dq, dk, dv = (torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v))
    for g in range(groups):
        hs, ks = _heads(g, groups, hq, hkv)
        qh, doh, oh = _bhnd(q, hs), _bhnd(dout, hs, q.dtype), _bhnd(out, hs)
        delta = row_dot(doh, oh, acc)  # D = rowsum(dO * O), [B, h, n]
        ld = torch.stack([backward_lse(lse[:, hs]), delta])  # [2, B, h, n]
        kv = _kv_pack(k, v, ks)
        accs = BackwardAccs(qh, kv[0])
        data = {("q", own["q"]): (qh, doh, ld), ("kv", own["kv"]): (kv,)}
        del qh, doh, ld, kv, delta
        res = run_plan(comm, plan, data, backward_compute(calls, own["q"], oh), accs)
        del oh
        dq_g = res.get(("q", own["q"])) or accs.zeros("q")
        dkv_g = res.get(("kv", own["kv"])) or accs.zeros("kv")
        dq[:, :, hs] = dq_g[0].transpose(1, 2)
        dk[:, :, ks] = dkv_g[0].transpose(1, 2)
        dv[:, :, ks] = dkv_g[1].transpose(1, 2)
    return dq, dk, dv

"""Entry points of the engine: one distributed attention forward / backward on flash-layout tensors.

``attention_forward`` and ``attention_backward`` take this rank's ``[B, n, H, D]`` shards as the
caller has them, and a plan (:func:`build_plan`, built once per shape and layout: :data:`PLANS`), and run the one loop
(:func:`.loop.run_plan`) with the block computations (:mod:`.compute`) for each *head group* in turn.
``attention_partials`` is the forward's unnormalised end: the merged ``(out, lse)`` in the
accumulators' dtype, for callers that merge further (decoding over a sharded cache).
``gathered_forward`` / ``gathered_backward`` run a :func:`~.plan.local` plan over K/V blocks that
are all held here (after an all-gather), with the same passes.

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

from ..comm.host import LruCache
from ..config import accum_dtype
from .compute import (BackwardAccs, BlockCalls, ForwardAccs, KVPack, backward_compute, forward_compute, held_kv,
                      query_side, stacked_kv)
from .direct import direct, distflash_steps, sparse_steps
from .loop import run_plan
from .merge import add_sinks_, sinks_grad
from .pairs import Blocks, ops_from_positions, positions_key
from .plan import DIRECT, AnyPlan, Key, Nested, Plan, local, ring, two_level

MIN_GROUP_ELEMENTS = 1 << 19  # 2 MiB of float32 queries per group (1 MiB bfloat16)


def head_groups(batch: int, local_seq: int, q_heads: int, kv_heads: int, head_dim: int) -> int:
    """The number of head groups: the largest divisor G of ``kv_heads`` with at least
    :data:`MIN_GROUP_ELEMENTS` query elements (``batch * local_seq * q_heads / G * head_dim``) per group."""
    best = 1
    for g in range(1, kv_heads + 1):
        if kv_heads % g == 0 and batch * local_seq * (q_heads // g) * head_dim >= MIN_GROUP_ELEMENTS:
            best = g
    return best


PLANS = LruCache(128)
"""The one memo of plans: every plan built so far, by the values it is a pure function of, which every
layer of a model, and each layer's forward, recomputation and backward, repeat. :func:`build_plan` keys a
plan by its arguments and the positions' values; a caller that knows the same plan from fewer values (the
call path: shapes and layouts, before any positions are computed) keys it by those (:func:`memo_plan`)."""


def memo_plan(key: tuple, make):
    """The entry of ``key`` in :data:`PLANS` (a tagged tuple of every value it is a pure function of),
    built by ``make()`` on first use."""
    return PLANS.get(key, make)


def build_plan(rank: int, world_size: int, *, positions: list, causal: bool, travelling: str,
               schedule: str = "ring", ranks_per_node: int = 1, blocks: Optional[Blocks] = None,
               kv_positions: Optional[list] = None, mask_plan=None) -> AnyPlan:
    """This rank's plan for one pass (:func:`make_plan`), built once per distinct arguments and
    positions (:data:`PLANS`; ``blocks`` is part of the key: a mask's summary by its mask and lengths).
    ``mask_plan``: the former spelling of a masked call's plan, a
    :class:`~burstattn.masks.plan.MaskPlan`: its summary as ``blocks`` and schedule ``"sparse"``."""
    if mask_plan is not None:
        blocks, schedule = mask_plan.blocks, (schedule if schedule == "gathered" else "sparse")
    key = ("positions", rank, world_size, causal, travelling, schedule, ranks_per_node, blocks,
           tuple(positions_key(x) for x in positions),
           None if kv_positions is None else tuple(positions_key(x) for x in kv_positions))
    return memo_plan(key, lambda: make_plan(rank, world_size, positions=positions, causal=causal,
                                            travelling=travelling, schedule=schedule, ranks_per_node=ranks_per_node,
                                            blocks=blocks, kv_positions=kv_positions))


SCHEDULES = ("ring", "double", "distflash", "sparse", "gathered")


def make_plan(rank: int, world_size: int, *, positions: list, causal: bool, travelling: str,
              schedule: str = "ring", ranks_per_node: int = 1, blocks: Optional[Blocks] = None,
              kv_positions: Optional[list] = None) -> AnyPlan:
    """This rank's plan for one pass, from positions: the one producer of block ops
    (:func:`~.pairs.ops_from_positions` by ``blocks``) and a schedule over the pairs.

    ``positions[r]``: the global positions of rank r's queries (``[n_r]``) and ``kv_positions[r]`` of its
    keys (default: the same), in the coordinates ``blocks`` reads: the keys' for the default
    :func:`~.pairs.position_ops` (see :meth:`burstattn.AttnMask.aligned` when the two sequences differ),
    the queries' own for a mask's summary (:class:`burstattn.masks.blocks.MaskBlocks`, which aligns them
    itself). ``travelling``: the side that moves, ``"kv"`` (forward, RingAttention's backward) or ``"q"``
    (BurstAttention's backward; :meth:`burstattn.call.Call.travelling`). ``schedule``: ``"ring"``,
    ``"distflash"``, ``"double"`` (``ranks_per_node``), ``"sparse"`` (:func:`~.direct.sparse_steps`:
    transfers only for the non-empty pairs; masks and partitions), or ``"gathered"``: one step without
    transfers over every rank's K/V, held here after an all-gather (:func:`~.plan.local`)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    n = int(positions[rank].numel())
    ops_of = ops_from_positions(positions, positions if kv_positions is None else kv_positions, causal, blocks)
    if schedule == "gathered":
        return local(rank, list(range(world_size)), ops_of)
    if schedule == "sparse":
        return direct(rank, sparse_steps(rank, world_size, ops_of, travelling), world_size, ops_of, n, DIRECT)
    if schedule == "distflash":
        return direct(rank, distflash_steps(rank, world_size), world_size, ops_of, n, DIRECT)
    if schedule == "double" and world_size > 1:
        return two_level(rank, world_size, ranks_per_node, ops_of, travelling)
    return ring(rank, world_size, ops_of, travelling)


def _own(plan: AnyPlan) -> dict:
    """``side -> owner`` of the data a plan starts with (one owner per side)."""
    return {key.side: key.owner for key in (plan.outer if isinstance(plan, Nested) else plan).own}


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


def _forward_group(comm, plan: AnyPlan, calls: BlockCalls, data: dict, split, dv: int,
                   wire=None) -> tuple[torch.Tensor, torch.Tensor]:
    """One head group's forward: ``(out, lse)`` ``[B, h, n, Dv]``, ``[B, h, n]`` in the accumulator dtype.
    ``data`` (the query block and the K/V blocks held here) is handed over: the loop drops each block
    after its last use, so the caller keeps no other reference to them."""
    key = Key("q", _own(plan)["q"])
    accs = ForwardAccs(data[key][0], dv, wire)
    res = run_plan(comm, plan, data, forward_compute(calls, split), accs).get(key)
    return res if res is not None else accs.empty()


def attention_forward(comm, plan: AnyPlan, calls: BlockCalls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      groups: int = 1, sinks: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [B, n, Hq, D]``, ``k [B, n_k, Hkv, D]``, ``v [B, n_k, Hkv, Dv]`` -> ``out [B, n, Hq, Dv]``
    (q's dtype, contiguous) and ``lse [B, Hq, n]`` (float32; float64 for float64 inputs; ``-inf`` for
    rows that see nothing). ``sinks [Hq]``: attention-sink logits, added once after the last merge
    (:func:`~.merge.add_sinks_`), so ``lse`` includes them."""
    b, n, hq, d = q.shape
    hkv, dv = k.shape[2], v.shape[3]
    own = _own(plan)
    out = torch.empty(b, n, hq, dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, hq, n, dtype=accum_dtype(q.dtype), device=q.device)
    for g in range(groups):
        hs, ks = _heads(g, groups, hq, hkv)
        kv, pack = _kv_pack(k, v, ks)
        data = {Key("q", own["q"]): (_bhnd(q, hs),), Key("kv", own["kv"]): (kv,)}
        del kv
        o, l = _forward_group(comm, plan, calls.heads(hs), data, pack.payload_split, dv)
        if sinks is not None:
            add_sinks_(o, l, sinks[hs])
        out[:, :, hs] = o.transpose(1, 2)
        lse[:, hs] = l
    return out, lse


def attention_partials(comm, plan: AnyPlan, calls: BlockCalls, q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, wire: Optional[torch.dtype] = None,
                       hold_kv: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward's merged result before it is cast: ``out [B, Hq, n, Dv]`` and ``lse [B, Hq, n]``,
    both in the accumulator dtype (rows that see nothing: 0 and ``-inf``). Shapes of the inputs as
    :func:`attention_forward`; one head group. ``wire``: the dtype partials sent back travel in
    (default q's). ``hold_kv``: a K/V block the plan never sends is read in place (strided ``[B, h, n, D]``
    views), not copied into a message: for decoding, whose few queries read it once per call; where many
    query tiles reread it the copy pays (the kernels ran 5% slower on the views at N = 8192)."""
    own = _own(plan)
    q_data = (q.transpose(1, 2).contiguous(),)
    if hold_kv and not _fetches(plan, "kv"):
        data = {Key("q", own["q"]): q_data, Key("kv", own["kv"]): (k.transpose(1, 2), v.transpose(1, 2))}
        return _forward_group(comm, plan, calls, data, held_kv, v.shape[3], wire)
    kv, pack = _kv_pack(k, v, slice(None))
    data = {Key("q", own["q"]): q_data, Key("kv", own["kv"]): (kv,)}
    del kv
    return _forward_group(comm, plan, calls, data, pack.payload_split, v.shape[3], wire)


def _fetches(plan: AnyPlan, side: str) -> bool:
    """Whether any step of ``plan`` moves the ``side`` data (a two-level plan: assumed so)."""
    if not isinstance(plan, Plan):
        return True
    return any(mv.side == side for st in plan.steps for mv in st.fetch)


def _backward_group(comm, plan: AnyPlan, calls: BlockCalls, data: dict, out_h: torch.Tensor, split,
                    kv_shapes: tuple) -> tuple[dict, BackwardAccs]:
    """One head group's backward; ``data``: the query side (:func:`query_side`) and the K/V blocks held
    here, handed over as in :func:`_forward_group`. Returns the accumulators left here, and the
    accumulator rule (for zeros where none came)."""
    own = _own(plan)
    accs = BackwardAccs(data[Key("q", own["q"])][0], *kv_shapes)
    res = run_plan(comm, plan, data, backward_compute(calls, own["q"], out_h, split), accs)
    return res, accs


def attention_backward(comm, plan: AnyPlan, calls: BlockCalls, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, groups: int = 1,
                       sinks: Optional[torch.Tensor] = None):
    """Gradients for :func:`attention_forward`'s inputs: ``dq, dk, dv`` (shapes and dtypes of q, k, v)
    and ``dsinks [Hq]`` (float32; ``None`` without sinks: this rank's rows' share, summed over the
    group like any replicated parameter's gradient). The pass accumulates dQ and dK/dV in float32
    and writes them into the outputs."""
    b, n, hq, d = q.shape
    hkv, acc = k.shape[2], accum_dtype(q.dtype)
    own = _own(plan)
    dq, dk, dv = (torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v))
    dsinks = None if sinks is None else torch.zeros(hq, dtype=acc, device=q.device)
    for g in range(groups):
        hs, ks = _heads(g, groups, hq, hkv)
        oh = _bhnd(out, hs)
        side = query_side(_bhnd(q, hs), _bhnd(dout, hs, q.dtype), oh, lse[:, hs])
        if sinks is not None:
            dsinks[hs] = sinks_grad(lse[:, hs], side[2][1], sinks[hs])
        kv, pack = _kv_pack(k, v, ks)
        data = {Key("q", own["q"]): side, Key("kv", own["kv"]): (kv,)}
        del side, kv
        res, accs = _backward_group(comm, plan, calls.heads(hs), data, oh, pack.payload_split, (pack.k_shape, pack.v_shape))
        del oh
        dq_g = res.get(Key("q", own["q"])) or accs.zeros("q")
        dkv_g = res.get(Key("kv", own["kv"])) or accs.zeros("kv")
        dq[:, :, hs] = dq_g[0].transpose(1, 2)
        dk[:, :, ks] = dkv_g[0].transpose(1, 2)
        dv[:, :, ks] = dkv_g[1].transpose(1, 2)
    return dq, dk, dv, dsinks


def gathered_forward(plan: AnyPlan, calls: BlockCalls, q: torch.Tensor,
                     blocks: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """A :func:`~.plan.local` plan over K/V blocks held here: ``q [B, n, Hq, D]``, ``blocks`` owner ->
    ``[2, B, Hkv, n_k, D]`` (K and V stacked, as an all-gather delivers them) -> ``out [B, n, Hq, D]``
    (q's dtype) and ``lse [B, Hq, n]`` (accumulator dtype)."""
    dv = next(iter(blocks.values())).shape[-1]
    data = {Key("q", _own(plan)["q"]): (q.transpose(1, 2).contiguous(),),
            **{Key("kv", j): (kv,) for j, kv in blocks.items()}}
    o, lse = _forward_group(None, plan, calls, data, stacked_kv, dv)
    return o.transpose(1, 2).to(q.dtype).contiguous(), lse


def gathered_backward(plan: AnyPlan, calls: BlockCalls, dout: torch.Tensor, q: torch.Tensor, blocks: dict,
                      out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Gradients of :func:`gathered_forward`: ``dq [B, n, Hq, D]`` (accumulator dtype) and, per key
    owner with any work, ``(dk, dv)`` ``[B, Hkv, n_k, D]`` (accumulator dtype)."""
    oh = out.transpose(1, 2)
    some = next(iter(blocks.values())).shape[1:]
    data = {Key("q", _own(plan)["q"]): query_side(q.transpose(1, 2), dout.to(q.dtype).transpose(1, 2), oh, lse),
            **{Key("kv", j): (kv,) for j, kv in blocks.items()}}
    res, accs = _backward_group(None, plan, calls, data, oh, stacked_kv, (some, some))
    dq = (res.get(Key("q", _own(plan)["q"])) or accs.zeros("q"))[0]
    return dq.transpose(1, 2), {key.owner: a for key, a in res.items() if key.side == "kv"}


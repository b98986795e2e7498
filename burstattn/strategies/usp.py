"""``strategy="usp"``: the hybrid of Ulysses and a ring (USP, Fang & Zhao, 2024; LoongTrain's
head x context parallelism), with BurstAttention as the ring.

The P = ``ulysses_degree`` x ``ring_degree`` ranks form a grid: group rank
``ring_index * ulysses_degree + ulysses_index``. Ranks with the same ring index form a
Ulysses group (put them on fast links: one machine); ranks with the same Ulysses index form a
ring group (the slow links between machines). One call:

1. all-to-all in the Ulysses group (sequence -> heads, op ``qkv``): each rank gets
   ``Hq/ulysses_degree`` query heads (and the kv heads they read; kv heads are repeated to
   ``lcm(kv_heads, ulysses_degree)`` when needed, see :mod:`.heads`) over its ring shard;
2. :func:`burstattn.burst_attn_func` over the ring group, with the ring-level ``layout``;
3. all-to-all back (op ``out``). The backward mirrors it (autograd).

Layout: one meaning everywhere. The inputs are this rank's shard of ``layout`` over the whole group,
exactly as :func:`burstattn.shard_sequence` gives it (:func:`usp_positions`, :meth:`UspGroups.shard`).
After the all-to-all a ring index holds the shards of its Ulysses ranks; sorted locally into
increasing positions they are that ring index's shard of a ring-level layout
(:func:`ring_layout`): ``contiguous`` and ``zigzag`` stay themselves, ``striped`` and partitions
become an explicit partition (the masked engine's direct schedule).

Groups come from a ``DeviceMesh`` (``mesh``, dims ``("ring", "ulysses")``), from explicit
``ulysses_group`` and ``ring_group``, or from the degrees alone. Creating process groups is a
collective of the whole job and costs a rendezvous and file descriptors, so with degrees alone the
sub-groups are built on the first call and reused (:func:`burstattn.comm.groups.usp_subgroups`).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch
import torch.distributed as dist

from ..call.call import Call
from ..call.engine_adapter import backward_pass, forward_pass
from ..call.prepare import resolve_backward
from ..call.validate import check_inputs
from ..comm.collectives import Collectives
from ..comm.groups import UspGroups, group_context, group_name, mesh_usp_groups, resolve_group, usp_subgroups
from ..comm.host import host_side
from ..comm.stats import active_stats
from ..engine.bytes import accum_dtype, byte_totals, choose_backward, meta_bytes, ring_bytes
from ..layouts.named import local_positions
from ..masks.setup import plan_for
from ..ops import strategy_call
from .base import check_call
from .heads import a2a_bytes, heads_problem, heads_to_seq, kv_repeats, repeat_kv, seq_to_heads, unrepeat_kv
from .local import ALONE


def usp_positions(seq_len: int, *, ring_rank: int, ring_degree: int, ulysses_rank: int, ulysses_degree: int,
                  layout="zigzag") -> torch.Tensor:
    """Global positions held by the rank at ``(ring_rank, ulysses_rank)``: ``layout``'s assignment
    over the whole grid (group rank ``ring_rank * ulysses_degree + ulysses_rank``), the same as
    :func:`burstattn.shard_sequence` gives it. LongTensor ``[seq_len // (ring_degree * ulysses_degree)]``.
    Pure; raises ``ValueError`` when the length cannot be split so or an index is out of range."""
    if not (0 <= ulysses_rank < ulysses_degree and 0 <= ring_rank < ring_degree):
        raise ValueError(f"usp: (ring_rank, ulysses_rank) = ({ring_rank}, {ulysses_rank}) is outside the "
                         f"{ring_degree} x {ulysses_degree} grid")
    return local_positions(seq_len, ring_rank * ulysses_degree + ulysses_rank, ring_degree * ulysses_degree, layout)


def ring_layout(layout, seq_len: int, ulysses_degree: int, ring_degree: int):
    """The ring-level layout of a USP call and the row order after the Ulysses all-to-all.

    After :func:`.heads.seq_to_heads` ring index ``i`` holds the shards of its ``ulysses_degree``
    ranks concatenated in rank order. Returns ``(ring_layout, order)``: ``order`` (LongTensor
    ``[u*n]``, or ``None`` for the identity) sorts those rows into increasing global positions, and
    ``ring_layout`` names the sorted positions of every ring index: ``contiguous`` and ``zigzag``
    over the grid are ``contiguous`` and ``zigzag`` over the ring (zigzag's chunks are u times
    longer); any other layout (``striped``, a Partition) becomes an explicit
    :class:`~burstattn.layouts.partition.Partition` (the masked engine's direct schedule). Pure.
    """
    from ..layouts.partition import Partition

    u, r = ulysses_degree, ring_degree
    if u == 1:
        return layout, None
    per_ring = [torch.cat([local_positions(seq_len, i * u + j, u * r, layout) for j in range(u)]) for i in range(r)]
    sorted_rows = [rows.sort() for rows in per_ring]
    if layout in ("contiguous", "zigzag"):
        ring = layout
    else:
        name = layout if isinstance(layout, str) else layout.name
        ring = Partition(tuple(s.values for s in sorted_rows), name=f"usp-{name}")
    return ring, sorted_rows


def rows_order(sorted_rows, ring_rank: int) -> Optional[torch.Tensor]:
    """This ring index's sorting permutation (``None``: already sorted)."""
    if sorted_rows is None:
        return None
    idx = sorted_rows[ring_rank].indices
    return None if torch.equal(idx, torch.arange(len(idx))) else idx


def _given_groups(p: int, rank: int, ulysses_degree, ring_degree, mesh, ulysses_group, ring_group):
    """``(UspGroups or None, (u, r), problem or None)`` from the options, without building anything."""
    if mesh is not None:
        if ulysses_group is not None or ring_group is not None:
            return None, (0, 0), "give either mesh or ulysses_group and ring_group, not both"
        try:
            g = mesh_usp_groups(mesh)
        except (ValueError, AttributeError, RuntimeError, KeyError) as e:
            return None, (0, 0), str(e)
        ulysses_group, ring_group = g.ulysses_group, g.ring_group
    if (ulysses_group is None) != (ring_group is None):
        return None, (0, 0), "give both ulysses_group and ring_group (or neither)"
    if ulysses_group is None:
        if ulysses_degree is None and ring_degree is None:
            return None, (0, 0), ("needs ulysses_degree and/or ring_degree (their product the group size "
                                  f"{p}), a mesh, or ulysses_group and ring_group")
        if not all(x is None or (isinstance(x, int) and not isinstance(x, bool) and x >= 1)
                   for x in (ulysses_degree, ring_degree)):
            return None, (0, 0), (f"ulysses_degree and ring_degree must be positive ints, got "
                                  f"{ulysses_degree!r} and {ring_degree!r}")
        u = ulysses_degree if ulysses_degree is not None else p // ring_degree
        r = ring_degree if ring_degree is not None else p // ulysses_degree
        if u * r != p:
            return None, (0, 0), (f"ulysses_degree * ring_degree must equal the group size {p}, got "
                                  f"{ulysses_degree!r} * {ring_degree!r}")
        return None, (u, r), None
    u, r = dist.get_world_size(ulysses_group), dist.get_world_size(ring_group)
    ui, ri = dist.get_rank(ulysses_group), dist.get_rank(ring_group)
    for name, given, size in (("ulysses_degree", ulysses_degree, u), ("ring_degree", ring_degree, r)):
        if given is not None and given != size:
            return None, (u, r), f"{name}={given!r} but its group has {size} ranks"
    if u * r != p or rank != ri * u + ui:
        return None, (u, r), (f"the sub-groups must form a {r} x {u} grid of the group's {p} ranks with group "
                              f"rank = ring_index * ulysses_degree + ulysses_index; this is group rank {rank}, "
                              f"ring index {ri}, ulysses index {ui}")
    return UspGroups(ulysses_group, ring_group, u, r, ui, ri), (u, r), None


def run(q, k, v, keywords, *, ulysses_degree=None, ring_degree=None, mesh=None, ulysses_group=None,
        ring_group=None) -> torch.Tensor:
    """``q [B, n, Hq, D]``, ``k, v [B, n, Hkv, D]`` (this rank's shard in ``layout`` over the whole
    group, as :func:`burstattn.shard_sequence` gives it) -> ``[B, n, Hq, D]`` in q's dtype.
    ``keywords`` (:class:`~burstattn.call.options.Keywords`): ``backend``/``backward``/``grad_partials`` as in
    :func:`burst_attn_func` (the inner ring's), the rest at their defaults. Given only
    degrees, the sub-groups are built on the first call and reused (:func:`burstattn.comm.groups.usp_subgroups`).
    Runs as the custom op ``torch.ops.burstattn.attention_fwd`` (:mod:`burstattn.ops`; the sub-groups travel
    by name).

    Raises:
        ValueError / TypeError on every rank: invalid inputs (``check_inputs``), degrees that do
        not multiply to the group size, inconsistent groups/mesh, ``q_heads`` not divisible by
        ``ulysses_degree``.
    """
    where = group_context(keywords.group)
    groups, (u, r), problem = _given_groups(where.world_size, where.rank, ulysses_degree, ring_degree, mesh,
                                            ulysses_group, ring_group)
    if problem is None:
        problem = heads_problem(q.shape[2], u, "usp", "ulysses_degree") if isinstance(q, torch.Tensor) else None
    options = ({"ulysses_degree": u, "ring_degree": r} if groups is None else
               {"ulysses_group": group_name(groups.ulysses_group), "ring_group": group_name(groups.ring_group)})
    return strategy_call("usp", q, k, v, keywords, options=options, problem=problem and (ValueError, problem))


def _groups(call) -> UspGroups:
    """The call's sub-groups: given by name, or built once per degrees (:func:`usp_subgroups`)."""
    opts = dict(call.options)
    if "ulysses_group" in opts:
        ug, rg = resolve_group(opts["ulysses_group"]), resolve_group(opts["ring_group"])
        if ug is None:
            return UspGroups(None, None, 1, 1, 0, 0)
        return UspGroups(ug, rg, dist.get_world_size(ug), dist.get_world_size(rg), dist.get_rank(ug),
                         dist.get_rank(rg))
    return usp_subgroups(opts["ulysses_degree"], opts["ring_degree"], call.where.group)


def _degrees(call) -> tuple[int, int]:
    """``(ulysses_degree, ring_degree)`` without building anything (for shapes)."""
    opts = dict(call.options)
    if "ulysses_degree" in opts:
        return opts["ulysses_degree"], opts["ring_degree"]
    from torch.distributed.distributed_c10d import _get_group_size_by_name

    return tuple(_get_group_size_by_name(opts[name]) if opts[name] else 1 for name in ("ulysses_group", "ring_group"))


class _Inner:
    """The burst ring over the ring group of one call: where, config (resolved) and the row order."""

    def __init__(self, call, q, k) -> None:
        p = call.where.world_size
        self.groups = _groups(call)
        u, r = self.groups.ulysses_degree, self.groups.ring_degree
        self.u, self.reps = u, kv_repeats(k.shape[2], u)
        with host_side():  # positions and their order are host-side (real tensors in a dry run too)
            layout, sorted_rows = ring_layout(call.layout, q.shape[1] * p, u, r)
            self.order = rows_order(sorted_rows, self.groups.ring_rank)
        self.where = group_context(self.groups.ring_group) if self.groups.ring_group is not None else ALONE
        self.layout = layout

    def cfg(self, call, qh, kh, vh) -> Call:
        c = call
        inner = Call(causal=c.causal, softmax_scale=c.softmax_scale, layout=self.layout, backend=c.backend,
                     backward=c.backward, grad=c.grad, where=self.where, grad_partials=c.grad_partials)
        return replace(inner, backward=resolve_backward(inner, qh, kh, vh, self.where.world_size))

    def sort(self, x: torch.Tensor) -> torch.Tensor:  # rank order -> increasing global positions
        return x if self.order is None else x.index_select(1, self.order.to(x.device))

    def unsort(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.order is None else x.index_select(1, torch.argsort(self.order).to(x.device))

    def coll(self, phase: str) -> Optional[Collectives]:
        return Collectives(self.groups.ulysses_group, phase, active_stats()) if self.u > 1 else None


def check(call, q, k, v):
    """The input check on every rank of the whole group (the inner ring checks its own at its start)."""
    check_call(call, q, k, v, group_plan=False)
    return call


def plan_of(call, q, k):
    return None


def forward(call, q, k, v):
    """``out [B, n, Hq, D]`` and the saved ``[q, k, v, out, lse]`` of the inner burst ring (head shards
    of this ring index's sequence, sorted: ``[B, u*n, Hq/u, D]``, ``[B, u*n, Hkv'/u, D]``, LSE
    ``[B, Hq/u, u*n]``)."""
    inner = _Inner(call, q, k)
    coll = inner.coll("forward")
    # (B, n, H, D) -> (B, u*n, H/u, D): the u shards of this ring index, in rank order, then sorted
    heads = seq_to_heads([q, repeat_kv(k, inner.reps), repeat_kv(v, inner.reps)], coll, inner.u, "qkv")
    qh, kh, vh = (inner.sort(x).contiguous() for x in heads)
    del heads
    cfg = inner.cfg(call, qh, kh, vh)
    plan, problem = plan_for(qh, cfg, inner.where.rank, inner.where.world_size, kh.shape[1])
    check_inputs(qh, kh, vh, cfg, inner.where.group, inner.where.world_size, fn="burst_attn_func", problem=problem)
    oh, lse = forward_pass(inner.where, cfg, plan, qh, kh, vh)
    (out,) = heads_to_seq([inner.unsort(oh)], coll, inner.u, "out")  # (B, u*n, Hq/u, D) -> (B, n, Hq, D)
    return out, [qh, kh, vh, oh, lse]


BACKWARD_READS_INPUTS = False  # only the shapes and dtypes of q, k, v, out (the op keeps no copy of them)


def backward(call, dout, q, k, v, out, saved):
    """``dq, dk, dv``: the output's all-to-all in reverse (op ``out``), the inner ring's backward, the
    q/k/v all-to-all in reverse (op ``qkv``), the repeated kv heads' gradients summed."""
    qh, kh, vh, oh, lse = saved
    inner = _Inner(call, q, k)
    coll = inner.coll("backward")
    (doh,) = seq_to_heads([dout.to(q.dtype)], coll, inner.u, "out")
    cfg = inner.cfg(call, qh, kh, vh)
    plan = plan_for(qh, cfg, inner.where.rank, inner.where.world_size, kh.shape[1])[0]
    doh = inner.sort(doh)
    grads = backward_pass(inner.where, cfg, plan, doh, qh, kh, vh, oh, lse)[:3]
    del doh, saved, qh, kh, vh, oh, lse
    grads = [inner.unsort(g) for g in grads]
    dq, dk, dv = heads_to_seq(grads, coll, inner.u, "qkv")
    del grads
    return dq, unrepeat_kv(dk, inner.reps, k.dtype), unrepeat_kv(dv, inner.reps, v.dtype)


def fake(call, q, k, v):
    """Empty ``[out, *saved]`` of :func:`forward` (shapes only)."""
    b, n, hq, d = q.shape
    u, _ = _degrees(call)
    kvh = k.shape[2] * kv_repeats(k.shape[2], u) // u
    return [q.new_empty(b, n, hq, d), q.new_empty(b, u * n, hq // u, d), k.new_empty(b, u * n, kvh, d),
            v.new_empty(b, u * n, kvh, d), q.new_empty(b, u * n, hq // u, d),
            q.new_empty(b, hq // u, u * n, dtype=accum_dtype(q.dtype))]


def bytes_formula(*, batch: int, local_seq: int, world_size: int, q_heads: int, kv_heads: int, head_dim: int,
                  dtype: torch.dtype, ulysses_degree: int, backward: str = "auto", layout="zigzag",
                  causal: bool = False, rank: int = 0) -> dict:
    """Bytes group rank ``rank`` sends per call: ``{"forward", "backward", "ops": {(phase, op): bytes}}``:
    the Ulysses all-to-alls, the inner burst ring (:func:`burstattn.engine.bytes.ring_bytes`, or the masked
    engine's :func:`burstattn.masks.plan.mask_bytes` when the ring-level layout is a partition, see
    :func:`ring_layout`; with its own ``meta`` check over the ring group) and the outer input check."""
    from ..masks import AttnMask, choose_mask_backward, mask_bytes, mask_plan

    u, r = ulysses_degree, world_size // ulysses_degree
    inner = dict(batch=batch, local_seq=u * local_seq, q_heads=q_heads // u,
                 kv_heads=kv_heads * kv_repeats(kv_heads, u) // u, head_dim=head_dim, dtype=dtype)
    ring_level, _ = ring_layout(layout, local_seq * world_size, u, r)
    if isinstance(ring_level, str):
        mode = choose_backward(world_size=r, **inner) if backward == "auto" else backward
        ring_ops = ring_bytes(backward=mode, world_size=r, **inner)["ops"]
    else:
        mode = choose_mask_backward(**inner) if backward == "auto" else backward
        plan = mask_plan(AttnMask(), causal, local_seq * world_size, r, ring_level, rank // u)
        ring_ops = mask_bytes(plan, backward=mode, **inner)["ops"]
    return byte_totals(a2a_bytes(batch=batch, local_seq=local_seq, degree=u, q_heads=q_heads, kv_heads=kv_heads,
                                 head_dim=head_dim, dtype=dtype),
                       ring_ops, {("forward", "meta"): meta_bytes(world_size)})

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

Layout: the global sequence is split by ``layout`` over the ``ring_degree`` ring indices, and
each ring shard is split contiguously among its ``ulysses_degree`` ranks
(:func:`usp_positions`; :meth:`UspGroups.shard`). So the inputs are NOT sharded as
:func:`burstattn.shard_sequence` over the whole group would shard them (unless
``ulysses_degree == 1``).

Groups come from a ``DeviceMesh`` (``mesh``, dims ``("ring", "ulysses")``), from explicit
``ulysses_group`` and ``ring_group``, or from the degrees alone. Creating process groups is a
collective of the whole job and costs a rendezvous, so with degrees alone every call builds
new groups: build them once with :func:`usp_groups` and pass ``ulysses_group=g.ulysses_group,
ring_group=g.ring_group``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ..api import burst_attn_func
from ..formulas import byte_totals, choose_backward, meta_bytes, ring_bytes
from ..layout import local_positions
from .base import label, start
from .heads import a2a_bytes, heads_problem, heads_to_seq, kv_repeats, repeat_kv, seq_to_heads


def usp_positions(seq_len: int, *, ring_rank: int, ring_degree: int, ulysses_rank: int, ulysses_degree: int,
                  layout: str = "zigzag") -> torch.Tensor:
    """Global positions held by the rank at ``(ring_rank, ulysses_rank)``: LongTensor
    ``[seq_len // (ring_degree * ulysses_degree)]``. Pure; raises ``ValueError`` when the
    length cannot be split so."""
    ring_shard = local_positions(seq_len, ring_rank, ring_degree, layout)
    if len(ring_shard) % ulysses_degree or not 0 <= ulysses_rank < ulysses_degree:
        raise ValueError(f"usp: a ring shard of {len(ring_shard)} tokens cannot be split among "
                         f"{ulysses_degree} Ulysses ranks (or ulysses_rank {ulysses_rank} is out of range)")
    n = len(ring_shard) // ulysses_degree
    return ring_shard[ulysses_rank * n:(ulysses_rank + 1) * n]


@dataclass(frozen=True)
class UspGroups:
    """The two sub-groups of a USP call and this rank's indices in them (``None`` groups: a
    world of one without ``torch.distributed``)."""

    ulysses_group: Optional[dist.ProcessGroup]
    ring_group: Optional[dist.ProcessGroup]
    ulysses_degree: int
    ring_degree: int
    ulysses_rank: int
    ring_rank: int

    def positions(self, seq_len: int, layout: str = "zigzag") -> torch.Tensor:
        """Global positions this rank holds (:func:`usp_positions`)."""
        return usp_positions(seq_len, ring_rank=self.ring_rank, ring_degree=self.ring_degree,
                             ulysses_rank=self.ulysses_rank, ulysses_degree=self.ulysses_degree, layout=layout)

    def shard(self, x: torch.Tensor, layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
        """This rank's shard of a full-sequence tensor (``dim`` the sequence). Differentiable."""
        return x.index_select(dim, self.positions(x.shape[dim], layout).to(x.device))


def usp_groups(ulysses_degree: int, ring_degree: int, group: Optional[dist.ProcessGroup] = None) -> UspGroups:
    """Build the Ulysses and ring sub-groups of ``group`` (default: the world) once.

    Every process of the job must call it with the same arguments, in the same order relative
    to other group creations (a rule of ``dist.new_group``); so ``group`` must span the whole
    job. For a smaller group, build the sub-groups yourself (or with a ``DeviceMesh``).

    Raises:
        ValueError: the degrees do not multiply to the group size, or ``group`` is not the job.
    """
    if not dist.is_available() or not dist.is_initialized():
        if (ulysses_degree, ring_degree) != (1, 1) or group is not None:
            raise ValueError("usp_groups: torch.distributed is not initialized; only degrees (1, 1) work")
        return UspGroups(None, None, 1, 1, 0, 0)
    group = group if group is not None else dist.group.WORLD
    p = dist.get_world_size(group)
    if ulysses_degree * ring_degree != p:
        raise ValueError(f"usp_groups: ulysses_degree * ring_degree must equal the group size {p}, "
                         f"got {ulysses_degree} * {ring_degree}")
    if p != dist.get_world_size():
        raise ValueError("usp_groups: group must span every process of the job (dist.new_group is a "
                         "collective of the whole job); pass sub-groups or a DeviceMesh instead")
    # grid[ring_index, ulysses_index] = global rank of group rank ring_index * u + ulysses_index
    grid = torch.tensor([dist.get_global_rank(group, i) for i in range(p)]).view(ring_degree, ulysses_degree)
    ring_rank, ulysses_rank = divmod(dist.get_rank(group), ulysses_degree)
    ulysses = [dist.new_group(row.tolist()) for row in grid]  # every process creates every group
    rings = [dist.new_group(col.tolist()) for col in grid.t()]
    return UspGroups(ulysses[ring_rank], rings[ulysses_rank], ulysses_degree, ring_degree, ulysses_rank, ring_rank)


def _given_groups(p: int, rank: int, ulysses_degree, ring_degree, mesh, ulysses_group, ring_group):
    """``(UspGroups or None, (u, r), problem or None)`` from the options, without building anything."""
    if mesh is not None:
        if ulysses_group is not None or ring_group is not None:
            return None, (0, 0), "give either mesh or ulysses_group and ring_group, not both"
        if tuple(getattr(mesh, "mesh_dim_names", None) or ()) != ("ring", "ulysses"):
            return None, (0, 0), (f"mesh must be 2-D with mesh_dim_names ('ring', 'ulysses'), got "
                                  f"{getattr(mesh, 'mesh_dim_names', None)}")
        ulysses_group, ring_group = mesh.get_group("ulysses"), mesh.get_group("ring")
    if (ulysses_group is None) != (ring_group is None):
        return None, (0, 0), "give both ulysses_group and ring_group (or neither)"
    if ulysses_group is None:
        if ulysses_degree is None and ring_degree is None:
            return None, (0, 0), ("needs ulysses_degree and/or ring_degree (their product the group size "
                                  f"{p}), a mesh, or ulysses_group and ring_group")
        u = ulysses_degree if ulysses_degree is not None else p // max(int(ring_degree), 1)
        r = ring_degree if ring_degree is not None else p // max(int(ulysses_degree), 1)
        if not all(isinstance(x, int) and x >= 1 for x in (u, r)) or u * r != p:
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


def run(q, k, v, *, group, causal, softmax_scale, layout, backend="auto", backward="auto", ulysses_degree=None,
        ring_degree=None, mesh=None, ulysses_group=None, ring_group=None) -> torch.Tensor:
    """``q [B, n, Hq, D]``, ``k, v [B, n, Hkv, D]`` (this rank's shard, :func:`usp_positions`) ->
    ``[B, n, Hq, D]`` in q's dtype. ``backend``/``backward``: as in :func:`burst_attn_func`.

    Raises:
        ValueError / TypeError on every rank: invalid inputs (``check_inputs``), degrees that do
        not multiply to the group size, inconsistent groups/mesh, ``q_heads`` not divisible by
        ``ulysses_degree``.
    """
    p, rank = 1, 0
    if dist.is_available() and dist.is_initialized():
        g = group if group is not None else dist.group.WORLD
        p, rank = dist.get_world_size(g), dist.get_rank(g)
    groups, (u, r), problem = _given_groups(p, rank, ulysses_degree, ring_degree, mesh, ulysses_group, ring_group)
    ring, _ = start("usp", q, k, v, group=group, causal=causal, softmax_scale=softmax_scale, layout=layout,
                    backend=backend, backward=backward, extra=problem and (ValueError, problem))
    problem = heads_problem(q.shape[2], u, "usp", "ulysses_degree")
    if problem:
        raise ValueError(f"{label('usp')}: {problem}")
    if groups is None:
        groups = usp_groups(u, r, ring.group)
    reps = kv_repeats(k.shape[2], u)
    # (B, n, H, D) -> (B, u*n, H/u, D): this ring index's shard, in the ring-level layout
    qh, kh, vh = seq_to_heads([q, repeat_kv(k, reps), repeat_kv(v, reps)], groups.ulysses_group, u, "qkv")
    out = burst_attn_func(qh, kh, vh, group=groups.ring_group, causal=causal, softmax_scale=softmax_scale,
                          layout=layout, backend=backend, backward=backward)
    return heads_to_seq(out, groups.ulysses_group, u, "out")  # (B, u*n, Hq/u, D) -> (B, n, Hq, D)


def bytes_formula(*, batch: int, local_seq: int, world_size: int, q_heads: int, kv_heads: int, head_dim: int,
                  dtype: torch.dtype, ulysses_degree: int, backward: str = "auto") -> dict:
    """Bytes each rank sends per call: ``{"forward", "backward", "ops": {(phase, op): bytes}}``:
    the Ulysses all-to-alls, the inner burst ring (:func:`burstattn.formulas.ring_bytes`, with its
    own ``meta`` check over the ring group) and the outer input check."""
    u = ulysses_degree
    inner = dict(batch=batch, local_seq=u * local_seq, world_size=world_size // u, q_heads=q_heads // u,
                 kv_heads=kv_heads * kv_repeats(kv_heads, u) // u, head_dim=head_dim, dtype=dtype)
    mode = choose_backward(**inner) if backward == "auto" else backward
    return byte_totals(a2a_bytes(batch=batch, local_seq=local_seq, degree=u, q_heads=q_heads, kv_heads=kv_heads,
                                 head_dim=head_dim, dtype=dtype),
                       ring_bytes(backward=mode, **inner)["ops"], {("forward", "meta"): meta_bytes(world_size)})

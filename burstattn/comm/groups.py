"""Process groups and meshes: where a call runs (:class:`GroupContext`, from the one group-resolution
function :func:`group_context`), the two-level groups of ``schedule="double"``, USP's Ulysses x ring
grid, DeviceMesh helpers, and the group <-> name mapping the custom ops need.

Imports only torch, :mod:`.host` and :mod:`burstattn.layouts.named` (positions). Groups are always passed
explicitly; nothing here reads a global group except where ``group=None`` means the world.

Grid convention (USP and the double ring alike): the P = ``outer x inner`` ranks of ``group`` form
a grid with group rank ``outer_index * inner + inner_index``::

    grid = arange(P).view(outer, inner)    # row: one inner group (a node, a Ulysses group)
                                           # column: one outer group (a ring across nodes)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from ..layouts.named import local_positions
from .host import LruCache


def distributed() -> bool:
    """Whether ``torch.distributed`` is available and initialised."""
    return dist.is_available() and dist.is_initialized()


class GroupContext(NamedTuple):
    """Where a call runs: the process group (``None`` for a world of one without
    ``torch.distributed``), this rank in it and its size (``group, rank, world_size = ctx``)."""

    group: Optional[dist.ProcessGroup]
    rank: int
    world_size: int


def group_context(group: Optional[dist.ProcessGroup] = None) -> GroupContext:
    """The one group resolution: ``group``, or the world when ``None``; a world of one when
    ``torch.distributed`` is not initialised (then a given ``group`` raises ``ValueError``)."""
    if not distributed():
        if group is not None:
            raise ValueError("group was given but torch.distributed is not initialized")
        return GroupContext(None, 0, 1)
    group = group if group is not None else dist.group.WORLD
    return GroupContext(group, dist.get_rank(group), dist.get_world_size(group))


def named_context(name: str) -> GroupContext:
    """The :class:`GroupContext` of a group given by name (a custom op's argument; ``""``: a world
    of one)."""
    pg = resolve_group(name)
    return GroupContext(None, 0, 1) if pg is None else GroupContext(pg, dist.get_rank(pg), dist.get_world_size(pg))


def group_name(group: Optional[dist.ProcessGroup]) -> str:
    """The name a custom op takes for ``group`` (``""``: a world of one without torch.distributed)."""
    if group is None:
        return dist.group.WORLD.group_name if distributed() else ""
    return group.group_name


def resolve_group(name: str) -> Optional[dist.ProcessGroup]:
    """The process group named ``name`` (inverse of :func:`group_name`; ``""`` gives ``None``)."""
    if not name:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group  # the documented way for ops

    return _resolve_process_group(name)


@dataclass(frozen=True)
class TwoLevelGroups:
    """The process groups of a double ring (build once with :func:`two_level_groups`)."""

    inner_group: Optional[dist.ProcessGroup]   # the ranks of this rank's node
    outer_group: Optional[dist.ProcessGroup]   # the ranks with this rank's index on every node
    ranks_per_node: int
    nodes: int


@dataclass(frozen=True)
class UspGroups:
    """The two sub-groups of a USP call and this rank's indices in them (``None`` groups: a
    world of one without ``torch.distributed``). Group rank = ``ring_rank * ulysses_degree +
    ulysses_rank``."""

    ulysses_group: Optional[dist.ProcessGroup]
    ring_group: Optional[dist.ProcessGroup]
    ulysses_degree: int
    ring_degree: int
    ulysses_rank: int
    ring_rank: int

    @property
    def rank(self) -> int:
        """This rank's index in the whole ``ring_degree x ulysses_degree`` grid."""
        return self.ring_rank * self.ulysses_degree + self.ulysses_rank

    def positions(self, seq_len: int, layout="zigzag") -> torch.Tensor:
        """Global positions this rank holds: ``layout``'s assignment over the whole grid, the
        same as :func:`burstattn.sequence_positions` over the group (LongTensor ``[seq_len // P]``)."""
        return local_positions(seq_len, self.rank, self.ulysses_degree * self.ring_degree, layout)

    def shard(self, x: torch.Tensor, layout="zigzag", dim: int = 1) -> torch.Tensor:
        """This rank's shard of a full-sequence tensor (``dim`` the sequence). Differentiable."""
        return x.index_select(dim, self.positions(x.shape[dim], layout).to(x.device))


def grid_groups(inner: int, outer: int, group: Optional[dist.ProcessGroup] = None):
    """``(inner group, outer group, inner index, outer index)`` of this rank in the
    ``outer x inner`` grid of ``group`` (default: the world). Collective over the whole job.

    Raises:
        ValueError: the sizes do not multiply to the group size, or ``group`` is not the job.
    """
    group = group if group is not None else dist.group.WORLD
    p = dist.get_world_size(group)
    if inner < 1 or outer < 1 or inner * outer != p:
        raise ValueError(f"the grid sizes must multiply to the group size {p}, got {inner} x {outer}")
    if p != dist.get_world_size():
        raise ValueError("group must span every process of the job (dist.new_group is a collective of the "
                         "whole job); pass sub-groups or a DeviceMesh instead")
    # grid[outer_index, inner_index] = global rank of group rank outer_index * inner + inner_index
    grid = torch.tensor([dist.get_global_rank(group, i) for i in range(p)]).view(outer, inner)
    outer_index, inner_index = divmod(dist.get_rank(group), inner)
    rows = [dist.new_group(row.tolist()) for row in grid]  # every process creates every group
    cols = [dist.new_group(col.tolist()) for col in grid.t()]
    return rows[outer_index], cols[inner_index], inner_index, outer_index


def usp_groups(ulysses_degree: int, ring_degree: int, group: Optional[dist.ProcessGroup] = None) -> UspGroups:
    """Build the Ulysses and ring sub-groups of ``group`` (default: the world) once.

    Every process of the job must call it with the same arguments, in the same order relative
    to other group creations (a rule of ``dist.new_group``); so ``group`` must span the whole
    job. For a smaller group, build the sub-groups yourself (or with a ``DeviceMesh``).

    Raises:
        ValueError: the degrees do not multiply to the group size, or ``group`` is not the job.
    """
    if not distributed():
        if (ulysses_degree, ring_degree) != (1, 1) or group is not None:
            raise ValueError("usp_groups: torch.distributed is not initialized; only degrees (1, 1) work")
        return UspGroups(None, None, 1, 1, 0, 0)
    try:
        u_group, r_group, ui, ri = grid_groups(ulysses_degree, ring_degree, group)
    except ValueError as e:
        raise ValueError(f"usp_groups: ulysses_degree x ring_degree: {e}") from None
    return UspGroups(u_group, r_group, ulysses_degree, ring_degree, ui, ri)


def two_level_groups(ranks_per_node: int, group: Optional[dist.ProcessGroup] = None) -> TwoLevelGroups:
    """Groups for ``schedule="double"``; ranks are numbered node by node (as torchrun does).
    Every process of the job must call it (``dist.new_group`` is collective)."""
    if not distributed():
        return TwoLevelGroups(None, None, 1, 1)
    world = dist.get_world_size(group if group is not None else dist.group.WORLD)
    if ranks_per_node < 1 or world % ranks_per_node:
        raise ValueError(f"two_level_groups: ranks_per_node must divide the group size {world}, got {ranks_per_node}")
    inner, outer, _, _ = grid_groups(ranks_per_node, world // ranks_per_node, group)  # inner = node
    return TwoLevelGroups(inner, outer, ranks_per_node, world // ranks_per_node)


def mesh_usp_groups(mesh) -> UspGroups:
    """:class:`UspGroups` of a 2-D ``DeviceMesh`` with ``mesh_dim_names == ("ring", "ulysses")``.

    Raises:
        ValueError: another shape or other dimension names.
    """
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if names != ("ring", "ulysses"):
        raise ValueError(f"mesh must be 2-D with mesh_dim_names ('ring', 'ulysses'), got {names or None}")
    u, r = mesh.get_group("ulysses"), mesh.get_group("ring")
    return UspGroups(u, r, dist.get_world_size(u), dist.get_world_size(r), dist.get_rank(u), dist.get_rank(r))


def usp_subgroups(ulysses_degree: int, ring_degree: int, group: Optional[dist.ProcessGroup] = None) -> UspGroups:
    """:func:`usp_groups`, built once per (parent group, degrees) and reused (:data:`SUBGROUPS`): creating
    a process group is a collective with a rendezvous and costs file descriptors, so a call given only
    degrees (``attention(strategy="usp", ulysses_degree=2, ring_degree=2)``) must not build new ones per
    call. An entry whose groups were destroyed (``dist.destroy_process_group``) is rebuilt."""
    return SUBGROUPS.get((group_name(group), ulysses_degree, ring_degree),
                         lambda: usp_groups(ulysses_degree, ring_degree, group),
                         lambda g: alive(g.ulysses_group) and alive(g.ring_group))


def alive(group: Optional[dist.ProcessGroup]) -> bool:
    """Whether ``group`` is still registered (not destroyed)."""
    if group is None:
        return True
    try:
        return resolve_group(group.group_name) is group
    except (RuntimeError, ValueError, KeyError):
        return False


# The process-wide memo of sub-groups (see usp_subgroups): process groups are themselves process-wide
# state of torch.distributed, and this only remembers which ones were made.
SUBGROUPS = LruCache(16)


def degree_groups(degrees, group: Optional[dist.ProcessGroup] = None) -> dict:
    """The aligned sub-groups of dynamic dispatch (:mod:`burstattn.parallel.dispatch`): for every
    degree d (a divisor of P), the group ``[g d, (g + 1) d)`` holding this rank; created once (every
    rank creates every group, in one order: ``new_group`` is collective) and reused every step.
    Degree P is ``group`` itself. Returns ``{degree: ProcessGroup}``."""
    ctx = group_context(group)
    ranks = dist.get_process_group_ranks(ctx.group) if ctx.group is not None else [0]
    out = {}
    for d in sorted(set(degrees)):
        if d < 1 or ctx.world_size % d:
            raise ValueError(f"degree_groups: every degree must divide the world size {ctx.world_size}, got {d}")
        if d == ctx.world_size:
            out[d] = ctx.group
            continue
        for g in range(ctx.world_size // d):
            pg = dist.new_group(ranks[g * d:(g + 1) * d])
            if g == ctx.rank // d:
                out[d] = pg
    return out

"""The process grid of a training job: one ``DeviceMesh`` with dimensions ``dp``, ``cp``, ``tp``.

Global rank ``r = (d * cp + c) * tp + t`` (row-major, torchtitan / picotron order): tensor-parallel
ranks are neighbours (put them on the fastest links), context-parallel ranks next, data-parallel
replicas outermost. Every group comes from the mesh and is passed explicitly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..comm.host import host_side
from ..strategies import STRATEGIES

TP_STRATEGIES = ("tp-v1", "tp-v3")
TP_VARIANTS = ("v1", "v3")
MESH_DIMS = ("dp", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of the three mesh dimensions (their product is the world size)."""

    dp: int = 1
    """Data-parallel replicas (each a slice of the global batch)."""
    cp: int = 1
    """Context-parallel ranks (each a shard of every sequence; attention over the ``cp`` group)."""
    tp: int = 1
    """Megatron tensor-parallel ranks (heads and MLP columns split)."""

    @property
    def world(self) -> int:
        return self.dp * self.cp * self.tp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(dp_rank, cp_rank, tp_rank)`` of global ``rank``."""
        rest, t = divmod(rank, self.tp)
        d, c = divmod(rest, self.cp)
        return d, c, t


def resolve_dims(world: int, strategy: str, dp: Optional[int] = None, cp: Optional[int] = None,
                 tp: Optional[int] = None) -> ParallelDims:
    """Degrees from the ones given: ``dp`` defaults to 1; the dimension not given takes the rest of
    the world (``cp`` for a sequence strategy, ``tp`` for ``tp-v1``/``tp-v3``; the other defaults to 1).

    Raises:
        ValueError: unknown strategy, a degree that is not a positive int, or degrees that do not
            multiply to ``world``.
    """
    if strategy not in STRATEGIES and strategy not in TP_STRATEGIES:
        raise ValueError(f"strategy must be one of {sorted(STRATEGIES) + list(TP_STRATEGIES)}, got {strategy!r}")
    for name, value in (("dp", dp), ("cp", cp), ("tp", tp)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"--{name} must be a positive int, got {value!r}")
    dp = 1 if dp is None else dp
    rest_dim = "tp" if strategy in TP_STRATEGIES else "cp"
    given = {"cp": cp, "tp": tp}
    other = "cp" if rest_dim == "tp" else "tp"
    if given[other] is None:
        given[other] = 1
    if given[rest_dim] is None:
        fixed = dp * given[other]
        if world % fixed:
            raise ValueError(f"world size {world} is not divisible by dp * {other} = {fixed}")
        given[rest_dim] = world // fixed
    dims = ParallelDims(dp, given["cp"], given["tp"])
    if dims.world != world:
        raise ValueError(f"dp * cp * tp = {dp} * {dims.cp} * {dims.tp} = {dims.world} must equal the world size {world}")
    return dims


def build_mesh(dims: ParallelDims, device_type: str = "cpu") -> DeviceMesh:
    """The 3-D mesh ``(dp, cp, tp)`` over the default group (every process must call it).

    Raises:
        ValueError: torch.distributed is not initialised or its world size is not ``dims.world``.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("build_mesh: torch.distributed is not initialized")
    if dist.get_world_size() != dims.world:
        raise ValueError(f"build_mesh: dp * cp * tp = {dims.world} but the world size is {dist.get_world_size()}")
    with host_side():
        return init_device_mesh(device_type, (dims.dp, dims.cp, dims.tp), mesh_dim_names=MESH_DIMS)



def flat_mesh(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    """The 1-D mesh over dimensions ``names`` of ``mesh`` flattened (e.g. ``("dp", "cp")`` for FSDP).

    The one place that uses DeviceMesh's private ``_flatten`` (torchtitan does the same)."""
    if len(names) == 1:
        return mesh[names[0]]
    with host_side():
        return mesh[names]._flatten("_".join(names))


def build_usp_mesh(dims: ParallelDims, ulysses_degree: int, device_type: str = "cpu") -> DeviceMesh:
    """A 4-D mesh ``(dp, ring, ulysses, tp)`` that splits ``cp`` into USP's ring x Ulysses grid
    (cp rank = ring index * ulysses_degree + ulysses index, as ``strategy="usp"`` expects).

    Raises:
        ValueError: ``ulysses_degree`` does not divide ``cp``.
    """
    if ulysses_degree < 1 or dims.cp % ulysses_degree:
        raise ValueError(f"ulysses_degree ({ulysses_degree}) must divide cp ({dims.cp})")
    with host_side():
        return init_device_mesh(device_type, (dims.dp, dims.cp // ulysses_degree, ulysses_degree, dims.tp),
                                mesh_dim_names=("dp", "ring", "ulysses", "tp"))

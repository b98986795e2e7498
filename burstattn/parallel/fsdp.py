"""ZeRO with FSDP2 (``fully_shard``) over the flattened ``dp x cp`` mesh.

* ZeRO-3: parameters, gradients and optimizer state sharded; each block's parameters are
  all-gathered for its forward and again for its backward (``reshard_after_forward=True``).
* ZeRO-2-like: ``reshard_after_forward=False`` keeps the gathered parameters from the forward
  to the backward (one all-gather per block per step, more memory), gradients and optimizer state
  still sharded.

* ``offload=True`` (ZeRO-Offload; DeepSpeed ALST's one-GPU runs): FSDP2's ``CPUOffloadPolicy``: the
  sharded parameters, their gradients and the optimizer state live in host memory and the
  optimizer steps on the CPU; each block's shard is copied to the device for its all-gather and its
  reduced gradient shard copied back.

Context-parallel ranks hold the same weights, so they shard them like data-parallel ranks. The
loss of each rank is its share of the global mean (see :mod:`.loss`), so gradients must be SUMMED
over ``dp x cp``: the divide factor is set to 1.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from ..comm.host import host_side


def mixed_precision(param_dtype: torch.dtype) -> Optional[MixedPrecisionPolicy]:
    """bf16/fp16 compute with float32 gradient reduction and float32 master weights (``None`` for
    float32: no policy)."""
    if param_dtype == torch.float32:
        return None
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)


@contextlib.contextmanager
def _mesh_coordinates_on_host():
    """Inside the block, a DeviceMesh finds this rank's coordinates on real host tensors.

    FSDP2 over tensor-parallel parameters concatenates the ``(dp x cp)`` and ``tp`` meshes per parameter
    (``DeviceMesh._concatenate``), and the new mesh finds its coordinates (``_compute_coordinate_on_dim``) with
    ``(mesh == rank).nonzero()``
    on its rank list: host bookkeeping, no device memory. Inside the dry run's ``FakeTensorMode`` that
    list would be a fake tensor, and ``nonzero`` has no fake kernel (its output shape depends on the
    data). Outside a fake mode the block changes nothing: :func:`~burstattn.comm.host.host_side` is then a
    no-op. PyTorch releases without that method are left as they are."""
    from torch.distributed.device_mesh import DeviceMesh as Mesh

    original = Mesh.__dict__.get("_compute_coordinate_on_dim")
    if original is None:
        yield
        return

    def on_host(self):
        with host_side():
            return original(self)

    Mesh._compute_coordinate_on_dim = on_host
    try:
        yield
    finally:
        Mesh._compute_coordinate_on_dim = original


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, *, zero: int = 3,
               mp_policy: Optional[MixedPrecisionPolicy] = None, offload: bool = False) -> nn.Module:
    """Shard ``model`` (a :class:`~burstattn.models.Llama`, possibly tensor-parallel already) over
    the 1-D ``mesh``: one FSDP unit per block plus the root (embedding, final norm, head);
    ``offload``: the shards, gradients and optimizer state in host memory (``CPUOffloadPolicy``,
    pinned when the mesh is on a GPU).

    Raises:
        ValueError: ``zero`` is not 2 or 3.
    """
    if zero not in (2, 3):
        raise ValueError(f"zero must be 2 or 3, got {zero!r}")
    kwargs = dict(mesh=mesh, reshard_after_forward=zero == 3)
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda")
    with _mesh_coordinates_on_host():
        for unit in [*model.layers, model]:  # blocks first, the root (embedding, norm, head) last
            fully_shard(unit, **kwargs)
    for unit in [*model.layers, model]:
        unit.set_gradient_divide_factor(1.0)  # a sum, not a mean
        unit.set_force_sum_reduction_for_comms(True)  # plain SUM collectives (gloo has no PREMUL_SUM)
    return model

"""Parallel plans for training: the ``dp x cp x tp`` mesh, context parallelism with every
strategy, Megatron tensor parallelism (``tp-v1``, ``tp-v3``), FSDP2 / ZeRO, the global loss."""
import sys

from .context import cp_attention, default_layout, shard_positions
from .fsdp import apply_fsdp, mixed_precision
from .loss import shift_labels, sharded_loss, sum_grads
from .mesh import MESH_DIMS, TP_STRATEGIES, ParallelDims, build_mesh, build_usp_mesh, flat_mesh, resolve_dims
from .tp import apply_tp, tp_problem

__all__ = ["ParallelDims", "resolve_dims", "build_mesh", "flat_mesh", "build_usp_mesh", "MESH_DIMS", "TP_STRATEGIES",
           "shard_positions", "cp_attention", "default_layout", "apply_tp", "tp_problem", "apply_fsdp",
           "mixed_precision", "shift_labels", "sharded_loss", "sum_grads"]


def __getattr__(name: str):
    # names that moved out of this module (the table burstattn.MOVED): resolved, or refused with the new spelling
    return sys.modules["burstattn"].moved_attribute(__name__, name)

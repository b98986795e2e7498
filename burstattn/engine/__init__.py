"""The ring engine: schedules (pure), the merge, and the ring loop with its passes."""
from .merge import merge_
from .ring import backward_kv, backward_query, forward, ring_loop
from .schedule import BlockOp, MaskKind, StepPlan, block_ops, rank_cost, ring_plan

__all__ = ["merge_", "forward", "backward_kv", "backward_query", "ring_loop", "BlockOp",
           "MaskKind", "StepPlan", "block_ops", "rank_cost", "ring_plan"]

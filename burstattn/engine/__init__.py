"""The engine: plans (pure), the one step loop, the passes, the merge."""
from .loop import Nested, run_plan
from .merge import merge_
from .plan import Move, Pair, Plan, Step, check_plans, ops_from_positions
from .ring import ring_loop
from .run import attention_backward, attention_forward, build_plan, head_groups
from .schedule import BlockOp, MaskKind, StepPlan, block_ops, position_ops, rank_cost, ring_plan

__all__ = ["merge_", "ring_loop", "BlockOp",
           "MaskKind", "StepPlan", "block_ops", "rank_cost", "ring_plan",
           "Plan", "Step", "Pair", "Move", "Nested", "run_plan", "check_plans", "ops_from_positions",
           "position_ops", "build_plan", "head_groups", "attention_forward", "attention_backward"]

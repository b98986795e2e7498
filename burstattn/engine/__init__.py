"""The engine: block ops from positions, plans (pure), the one step loop, the passes, the merge."""
from .direct import DirectStep, direct, distflash_steps, pass_q_steps
from .loop import Partial, Whole, run_plan
from .merge import merge_
from .pairs import BlockOp, MaskKind, ops_from_positions, position_ops
from .plan import (Channels, Key, Move, Nested, Pair, Plan, Step, check_plans, local, plan_cost, ring, ring_source,
                   two_level)
from .run import (attention_backward, attention_forward, attention_partials, build_plan, gathered_backward,
                  gathered_forward, head_groups)

__all__ = ["BlockOp", "MaskKind", "position_ops", "ops_from_positions",
           "Key", "Pair", "Move", "Step", "Plan", "Nested", "Channels", "ring", "ring_source", "two_level", "local",
           "plan_cost", "check_plans", "DirectStep", "direct", "distflash_steps", "pass_q_steps",
           "Partial", "Whole", "run_plan", "merge_",
           "build_plan", "head_groups", "attention_forward", "attention_backward", "attention_partials",
           "gathered_forward", "gathered_backward"]

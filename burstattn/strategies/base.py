"""What a strategy is (a differentiable function over sharded q/k/v plus what it accepts), and
the validation every strategy starts with."""
from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module
from typing import Callable, Optional

from ..call.validate import check_inputs
from ..masks.setup import plan_for
from ..masks.spec import MASK_KEYWORDS

MASK_OPTIONS = MASK_KEYWORDS  # the mask keywords (:class:`~burstattn.masks.spec.MaskKeywords`), by their old name


@dataclass(frozen=True)
class StrategySpec:
    """One way of distributing attention.

    Attributes:
        name: the ``strategy=`` value (and the module under ``burstattn.strategies`` holding its ``run``).
        layouts: sequence layouts it accepts; ``default_layout`` is used when ``layout=None``.
        options: the keywords it takes beyond those of every strategy (``causal``, ``softmax_scale``,
            ``layout``, ``group``): :class:`~burstattn.call.options.Keywords`' that it supports and its own
            (usp's degrees); another keyword with a value other than its default is refused naming the strategy.
        defaults: ``(keyword, value)`` pairs where its default differs from ``burst_attn_func``'s.
        partitions: whether an explicit :class:`~burstattn.layouts.partition.Partition` is accepted as
            ``layout`` (every strategy but rsa).
    """

    name: str
    layouts: tuple[str, ...]
    default_layout: str
    options: tuple[str, ...]
    partitions: bool = False
    defaults: tuple = ()

    def bytes_formula(self) -> Callable:
        """``bytes_formula(*, batch, local_seq, world_size, q_heads, kv_heads, head_dim, dtype,
        **options) -> {"forward", "backward", "ops"}``: bytes each rank sends per call."""
        return import_module(f"burstattn.strategies.{self.name}").bytes_formula


def check_call(call, q, k, v, extra: Optional[tuple[type, str]] = None, group_plan: bool = True):
    """A strategy call's cross-rank input check (inside its op): ``check_inputs`` over the call's group,
    with the problem this rank found (``extra``, or the mask's: a sequence length it does not fit, a
    partition for another world size, a ``mask_mod`` that raises), so a bad input raises on every rank.
    The local check ran once already (:func:`burstattn.call.prepare.prepare`). Returns this rank's
    :class:`~burstattn.masks.plan.MaskPlan` over the group (``None`` for a dense call, or when
    ``group_plan`` is false: the strategy plans its own, after the check)."""
    where = call.where
    plan, problem = None, extra
    if problem is None:
        plan, problem = plan_for(q, call, where.rank, where.world_size, k.shape[1])
    check_inputs(q, k, v, call, where.group, where.world_size, fn=call.fn, problem=problem, alibi=call.alibi,
                 sinks=call.sinks)
    return plan if group_plan else None

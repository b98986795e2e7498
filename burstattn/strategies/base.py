"""What a strategy is (a differentiable function over sharded q/k/v plus what it accepts), and
the validation every strategy starts with."""
from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module
from typing import Callable, Optional

from ..call.validate import check_inputs
from ..masks.setup import plan_for

MASK_OPTIONS = ("window", "cu_seqlens", "document_ids", "mask_mod", "mask")
# the options of today's models (cross-attention, varlen documents of their own, score modifiers,
# sinks, flash-attn's flags): the engine strategies (burst, ring) take them all
MODEL_OPTIONS = ("kv_layout", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen", "max_seqlen_q", "max_seqlen_k",
                 "softcap", "alibi_slopes", "sinks", "dropout_p", "deterministic", "grad_partials",
                 "device_type")


MASK_ARGS = MASK_OPTIONS + ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen", "max_seqlen_q", "max_seqlen_k")


def split_options(options: dict) -> tuple[dict, dict]:
    """``(mask_args, model_args)`` of an engine strategy's options: what builds the mask, and the
    rest (``kv_layout``, the score modifiers, flash-attn's flags)."""
    mask_args = {k: v for k, v in options.items() if k in MASK_ARGS}
    return mask_args, {k: v for k, v in options.items() if k not in MASK_ARGS}


@dataclass(frozen=True)
class StrategySpec:
    """One way of distributing attention.

    Attributes:
        name: the ``strategy=`` value (and the module under ``burstattn.strategies`` holding its ``run``).
        layouts: sequence layouts it accepts; ``default_layout`` is used when ``layout=None``.
        options: the extra keyword options it takes (anything else is an error).
        partitions: whether an explicit :class:`~burstattn.layouts.partition.Partition` is accepted as
            ``layout`` (every strategy but rsa).
    """

    name: str
    layouts: tuple[str, ...]
    default_layout: str
    options: tuple[str, ...]
    partitions: bool = False

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

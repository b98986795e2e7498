"""What a strategy is (a differentiable function over sharded q/k/v plus what it accepts), and
the validation every strategy starts with."""
from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module
from typing import Callable, Optional

from ..config import AttnConfig
from ..groups import GroupContext, group_context
from ..masks.setup import plan_for
from ..validate import check_inputs, local_problem, scale_value

MASK_OPTIONS = ("window", "cu_seqlens", "document_ids", "mask_mod", "mask")
# the options of today's models (cross-attention, varlen documents of their own, score modifiers,
# sinks, flash-attn's flags): the engine strategies (burst, ring) take them all
MODEL_OPTIONS = ("kv_layout", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen", "max_seqlen_q", "max_seqlen_k",
                 "softcap", "alibi_slopes", "sinks", "dropout_p", "deterministic", "grad_partials")
ENGINE_STRATEGIES = ("burst", "ring")


MASK_ARGS = MASK_OPTIONS + ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen", "max_seqlen_q", "max_seqlen_k")


def split_options(options: dict) -> tuple[dict, dict]:
    """``(mask_args, model_args)`` of an engine strategy's options: what builds the mask, and the
    rest (``kv_layout``, the score modifiers, flash-attn's flags)."""
    mask_args = {k: v for k, v in options.items() if k in MASK_ARGS}
    return mask_args, {k: v for k, v in options.items() if k not in MASK_ARGS}


def one_sequence_problem(name: str, q, k, v) -> Optional[tuple[type, str]]:
    """Why a strategy that needs one sequence and one head size cannot take ``q, k, v``, or ``None``."""
    import torch

    if not all(isinstance(x, torch.Tensor) and x.dim() == 4 for x in (q, k, v)):
        return None  # the shared input check reports it
    if q.shape[1] != k.shape[1] or v.shape[3] != q.shape[3]:
        return ValueError, (f"strategy {name!r} needs queries and keys of one sequence (q.shape[1] == k.shape[1]) "
                            f"and one head size for q, k and v, got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                            f"v {tuple(v.shape)}; cross-attention, unequal lengths and a V head size of its own "
                            f"run on strategy {' or '.join(map(repr, ENGINE_STRATEGIES))}")
    return None


@dataclass(frozen=True)
class StrategySpec:
    """One way of distributing attention.

    Attributes:
        name: the ``strategy=`` value (and the module under ``burstattn.strategies`` holding its ``run``).
        layouts: sequence layouts it accepts; ``default_layout`` is used when ``layout=None``.
        options: the extra keyword options it takes (anything else is an error).
        partitions: whether an explicit :class:`~burstattn.partition.Partition` is accepted as
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


def label(name: str) -> str:
    """How a strategy names itself in error messages: ``attention(strategy='name')``."""
    return f"attention(strategy={name!r})"


def start(name: str, q, k, v, *, group, causal: bool, softmax_scale, layout: str, backend: str = "auto",
          backward: str = "auto", extra: Optional[tuple[type, str]] = None) -> tuple[GroupContext, AttnConfig]:
    """Every strategy's first step: resolve ``group`` and run :func:`~burstattn.validate.check_inputs`
    (so bad input raises on every rank; ``extra`` is a problem the strategy found in its own
    options on this rank, shared the same way). Returns the group context and the config."""
    where = group_context(group)
    cfg = AttnConfig(causal=causal, softmax_scale=scale_value(softmax_scale), layout=layout, backend=backend,
                     backward=backward)
    extra = extra or one_sequence_problem(name, q, k, v)
    check_inputs(q, k, v, cfg, where.group, where.world_size, fn=label(name), extra=extra)
    return where, cfg


def check_call(call, q, k, v, extra: Optional[tuple[type, str]] = None, group_plan: bool = True):
    """A strategy call's cross-rank input check (inside its op): ``check_inputs`` over the call's group,
    with the problem this rank found (``extra``, or the mask's: a sequence length it does not fit, a
    partition for another world size, a ``mask_mod`` that raises), so a bad input raises on every rank.
    Returns this rank's :class:`~burstattn.masks.plan.MaskPlan` over the group (``None`` for a dense call,
    or when ``group_plan`` is false: the strategy plans its own, after the check)."""
    where, cfg = call.where, call.cfg
    plan, problem = None, extra
    if problem is None and local_problem(q, k, v, cfg) is None:
        plan, problem = plan_for(q, cfg, where.rank, where.world_size, k.shape[1])
    check_inputs(q, k, v, cfg, where.group, where.world_size, fn=call.fn, extra=problem)
    return plan if group_plan else None

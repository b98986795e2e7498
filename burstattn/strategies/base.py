"""What a strategy is (a differentiable function over sharded q/k/v plus what it accepts), and
the validation every strategy starts with."""
from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module
from typing import Callable, Optional

from ..api import ring_context
from ..autograd import RingContext
from ..config import AttnConfig
from ..masks.setup import checked_config
from ..validate import check_inputs, scale_value

MASK_OPTIONS = ("window", "cu_seqlens", "document_ids", "mask_mod", "mask")


@dataclass(frozen=True)
class StrategySpec:
    """One way of distributing attention.

    Attributes:
        name: the ``strategy=`` value.
        module: module (under ``burstattn.strategies``) holding ``run``; imported on first use.
        layouts: sequence layouts it accepts; ``default_layout`` is used when ``layout=None``.
        options: the extra keyword options it takes (anything else is an error).
        summary: one line for error messages and docs.
        partitions: whether an explicit :class:`~burstattn.partition.Partition` is accepted as
            ``layout`` (strategies that place tokens by position: burst, allgather, ulysses).
    """

    name: str
    module: str
    layouts: tuple[str, ...]
    default_layout: str
    options: tuple[str, ...]
    summary: str
    partitions: bool = False  # whether ``layout`` may be an explicit burstattn.partition.Partition

    def runner(self) -> Callable:
        """``run(q, k, v, *, group, causal, softmax_scale, layout, **options) -> out``."""
        return import_module(f"burstattn.strategies.{self.module}").run

    def bytes_formula(self) -> Callable:
        """``bytes_formula(*, batch, local_seq, world_size, q_heads, kv_heads, head_dim, dtype,
        **options) -> {"forward", "backward", "ops"}``: bytes each rank sends per call."""
        return import_module(f"burstattn.strategies.{self.module}").bytes_formula


def label(name: str) -> str:
    """How a strategy names itself in error messages: ``attention(strategy='name')``."""
    return f"attention(strategy={name!r})"


def start(name: str, q, k, v, *, group, causal: bool, softmax_scale, layout: str, backend: str = "auto",
          backward: str = "auto", extra: Optional[tuple[type, str]] = None) -> tuple[RingContext, AttnConfig]:
    """Every strategy's first step: resolve ``group`` and run :func:`~burstattn.validate.check_inputs`
    (so bad input raises on every rank; ``extra`` is a problem the strategy found in its own
    options on this rank, shared the same way). Returns the group context and the config."""
    ring = ring_context(group)
    cfg = AttnConfig(causal=causal, softmax_scale=scale_value(softmax_scale), layout=layout, backend=backend,
                     backward=backward)
    check_inputs(q, k, v, cfg, ring.group, ring.world_size, fn=label(name), extra=extra)
    return ring, cfg


def start_masked(name: str, q, k, v, *, group, causal: bool, softmax_scale, layout, backend: str = "auto",
                 mask_args: Optional[dict] = None):
    """:func:`start` for a strategy that takes masks (``mask_args``: its ``window`` / ``cu_seqlens``
    / ``document_ids`` / ``mask_mod`` / ``mask`` options). Returns ``(ring, cfg, plan)``: ``plan``
    is this rank's :class:`~burstattn.masks.plan.MaskPlan` (``None`` without a mask); a bad mask
    raises on every rank like any bad input."""
    ring = ring_context(group)
    cfg, plan = checked_config(q, k, v, ring, mask_args or {}, label(name), causal=causal,
                               softmax_scale=scale_value(softmax_scale), layout=layout, backend=backend)
    return ring, cfg, plan

"""The flat ring on the one loop for strategies with their own compute (``rsa``): :func:`ring_loop`
over a flat ring plan (tuples of :class:`~.schedule.StepPlan`, from :func:`~.schedule.ring_plan`).
burst attention itself calls :mod:`.run`, which runs every schedule and the masks.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ..comm.ring import RingComm
from .loop import run_plan
from .plan import ring
from .schedule import StepPlan, ring_source

__all__ = ["ring_loop"]


class _LoopAccs:
    """:func:`ring_loop`'s travelling accumulator: ``fold(acc, contributions)`` in place."""

    def __init__(self, acc_init: Optional[torch.Tensor], fold: Optional[Callable]) -> None:
        self.sides = frozenset({"kv"}) if acc_init is not None else frozenset()
        self.acc_init, self.user_fold = acc_init, fold

    def fold(self, side, acc, c):
        acc = (torch.zeros_like(self.acc_init),) if acc is None else acc
        if c[0] == "acc":
            acc[0].add_(c[1][0])
        else:
            self.user_fold(acc[0], c[1])
        return acc

    def wire(self, side, acc):
        return (torch.zeros_like(self.acc_init),) if acc is None else acc

    def like(self, side):
        return (torch.empty_like(self.acc_init),)

    def received(self, side, acc, bufs):
        if acc is None:
            return bufs
        acc[0].add_(bufs[0])
        return acc


def ring_loop(comm: Optional[RingComm], plans: tuple[StepPlan, ...], carry: torch.Tensor,
              channel: str, compute: Callable, acc_channel: Optional[str] = None,
              acc_init: Optional[torch.Tensor] = None, fold: Optional[Callable] = None) -> Optional[torch.Tensor]:
    """Run a flat ring plan with ``carry`` (this rank's block) travelling, on the one loop.

    ``compute(plan, block) -> contributions`` for the block held at each step; with ``acc_channel``,
    ``acc_init`` (zeros of the accumulator's shape) and ``fold(acc, contributions)``, the block's
    accumulator follows one step behind and this rank's comes home: it is returned.
    """
    rank, world = (comm.rank, comm.world_size) if comm is not None else (0, 1)
    by_owner = {ring_source(rank, p.step, world): p for p in plans}
    labels = {("data", "kv"): channel, ("acc", "kv"): acc_channel or f"{channel}_acc"}
    plan = ring(rank, world, lambda q, k: (), "kv", labels=labels)

    def step_compute(pair, data):
        parts = compute(by_owner[pair.k], data[("kv", pair.k)][0])
        return [("kv", pair.k, (None, parts))] if acc_init is not None else []

    res = run_plan(comm, plan, {("kv", rank): (carry,), ("q", rank): ()}, step_compute, _LoopAccs(acc_init, fold))
    return None if acc_init is None else res.get(("kv", rank), (torch.zeros_like(acc_init),))[0]

"""The one step loop: runs a :class:`~.plan.Plan` with a pass's compute and accumulators.

Per step: post the fetches (the data of the next step: double buffering), compute the step's pairs,
wait for the accumulators given at the previous step and fold them and this step's contributions,
post this step's gives, wait for the fetches. Data and accumulators are keyed ``(side, owner)``;
received data gets a fresh buffer (nothing the loop still sends is overwritten) and every buffer is
dropped after its last use, so a ring holds two travelling blocks and a direct schedule as many as
its step needs. A nested plan (:class:`Nested`, the two-level ring) runs this same loop inside the
compute of an outer one.

The pass plugs in ``compute(pair, data) -> [(side, owner, contribution)]`` and an :class:`Accs`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import torch

from ..comm.trace import now_ns
from .plan import Pair, Plan

Payload = tuple[torch.Tensor, ...]


class Accs(Protocol):
    """How a pass accumulates (``side``: ``"q"`` or ``"kv"``; an accumulator is a tuple of tensors)."""

    sides: frozenset

    def fold(self, side: str, acc: Optional[Payload], contribution) -> Payload:
        """``acc`` (``None``: none yet) plus a contribution (a kernel partial or a whole accumulator)."""

    def wire(self, side: str, acc: Optional[Payload]) -> Payload:
        """The tensors sent for ``acc`` (``None``: an empty one)."""

    def like(self, side: str) -> Payload:
        """Receive buffers for one accumulator of ``side``."""

    def received(self, side: str, acc: Optional[Payload], bufs: Payload) -> Payload:
        """``acc`` plus a received accumulator."""


@dataclass(frozen=True)
class Nested:
    """A two-level plan: ``outer`` (over the outer group) whose step d runs ``inner[d]`` (over the
    inner group) on the block it holds."""

    outer: Plan
    inner: tuple[Plan, ...]


def _post(comm, label: str, moves, tensors_of, t: int) -> None:
    for mv, xs in zip(moves, tensors_of):
        for x in xs:
            comm.queue(label, "send" if mv.send else "recv", x, mv.peer, label)
    if moves:
        comm.commit(label, t)


def _last_uses(plan: Plan) -> dict:
    last: dict = {}
    for i, st in enumerate(plan.steps):
        for pr in st.pairs:
            last[("q", pr.q)] = last[("kv", pr.k)] = i
        for mv in st.fetch:
            if mv.send:
                last[(mv.side, mv.owner)] = i
    return last


class _Flight:
    """The accumulator transfers in flight: what this rank receives, and what it sends (kept alive)."""

    def __init__(self) -> None:
        self.taking: dict = {}
        self.sending: list = []
        self.channels: list = []

    def land(self, comm, accs: Accs, acc: dict, t: int) -> None:
        """Wait for everything in flight; fold the received accumulators in."""
        for label in self.channels:
            comm.wait(label, t)
        for key, bufs in self.taking.items():
            acc[key] = accs.received(key[0], acc.get(key), bufs)
        self.taking, self.sending, self.channels = {}, [], []


def run_plan(comm, plan, data: dict, compute: Callable, accs: Accs, like: Optional[Callable] = None) -> dict:
    """Run ``plan`` (a :class:`~.plan.Plan`; or :class:`Nested` with ``comm`` holding ``.inner`` and
    ``.outer`` communicators, :class:`~.double.TwoLevelComm`).

    Args:
        comm: the :class:`~burstattn.comm.ring.RingComm` of the plan's group (``None``: one rank).
        data: ``(side, owner) -> payload`` (a tuple of tensors) of the data held at the start (the
            plan's ``own``); the loop drops its references after their last use.
        compute: ``compute(pair, data) -> iterable of (side, owner, contribution)``.
        like: ``like(side, owner) -> payload``: receive buffers for another owner's data (default:
            shaped like this rank's own; owners whose shards differ in length need their own).
    Returns the accumulators left on this rank, ``(side, owner) -> acc`` (its own, and for plans
    that keep partials of other owners, e.g. after an all-gather, theirs).
    """
    if isinstance(plan, Nested):
        return _run_nested(comm, plan, data, compute, accs, like)
    if comm is not None:
        comm.open_channels(plan.channels())
    last = _last_uses(plan)
    if like is None:
        shapes = {side: [(x.shape, x.dtype, x.device) for x in data[(side, o)]] for side, o in plan.own
                  if (side, o) in data}

        def like(side: str, owner: int) -> Payload:
            return tuple(torch.empty(s, dtype=dt, device=dev) for s, dt, dev in shapes[side])
    acc: dict = {}
    flight = _Flight()
    for i, st in enumerate(plan.steps):
        incoming = []
        for side in ("kv", "q"):
            moves = [mv for mv in st.fetch if mv.side == side]
            bufs = []
            for mv in moves:
                if mv.send:
                    bufs.append(data[(mv.side, mv.owner)])
                else:  # a fresh buffer: the block this rank is sending is never overwritten
                    bufs.append(like(side, mv.owner))
                    incoming.append(((mv.side, mv.owner), bufs[-1]))
            if moves:
                _post(comm, plan.labels[("data", side)], moves, bufs, st.index)
        t0 = now_ns()
        deferred = []
        for pr in st.pairs:
            for side, owner, c in compute(pr, data):
                if (side, owner) in flight.taking:  # its accumulator is still on the way here
                    deferred.append((side, owner, c))
                else:
                    acc[(side, owner)] = accs.fold(side, acc.get((side, owner)), c)
        if comm is not None and comm.trace is not None:
            label = plan.labels[("data", st.fetch[0].side)] if st.fetch else plan.labels.get(("data", "kv"), "kv")
            comm.trace.record("compute", comm.phase, label, st.index, comm.rank, t0, now_ns())
        flight.land(comm, accs, acc, st.index)
        for side, owner, c in deferred:
            acc[(side, owner)] = accs.fold(side, acc.get((side, owner)), c)
        gives = [mv for mv in st.give if mv.side in accs.sides]
        for side in ("kv", "q"):
            moves = [mv for mv in gives if mv.side == side]
            bufs = []
            for mv in moves:
                if mv.send:
                    bufs.append(accs.wire(side, acc.pop((side, mv.owner), None)))
                    flight.sending.append(bufs[-1])
                else:
                    bufs.append(accs.like(side))
                    flight.taking[(side, mv.owner)] = bufs[-1]
            if moves:
                _post(comm, plan.labels[("acc", side)], moves, bufs, st.index)
                flight.channels.append(plan.labels[("acc", side)])
        for side in ("kv", "q"):
            if any(mv.side == side for mv in st.fetch):
                comm.wait(plan.labels[("data", side)], st.index)
        for key, bufs in incoming:
            data[key] = bufs
        for key in [k for k in data if last.get(k, -1) <= i]:
            del data[key]
    flight.land(comm, accs, acc, len(plan.steps))
    return acc


def _run_nested(levels, plan: Nested, data: dict, compute: Callable, accs: Accs, like) -> dict:
    """The outer ring's step d computes by running ``plan.inner[d]`` on the block it holds; the inner
    ring's accumulators come back as contributions of that step."""
    inner_comm = levels.inner if levels is not None else None
    outer_comm = levels.outer if levels is not None else None
    step_of = {(pr.q, pr.k): d for d, st in enumerate(plan.outer.steps) for pr in st.pairs}

    def outer_compute(pair: Pair, outer_data: dict):
        inner = plan.inner[step_of[(pair.q, pair.k)]]
        res = run_plan(inner_comm, inner, {key: outer_data[key] for key in inner.own}, compute, accs, like)
        return [(side, owner, ("acc", a)) for (side, owner), a in res.items()]

    return run_plan(outer_comm, plan.outer, data, outer_compute, accs, like)

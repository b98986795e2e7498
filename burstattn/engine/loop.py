"""The one step loop: runs a :class:`~.plan.Plan` with a pass's compute and accumulators.

Per step: post the fetches (the data of the next step: double buffering), compute the step's pairs,
wait for the accumulators given at the previous step and fold them and this step's contributions,
post this step's gives, wait for the fetches. Data and accumulators are named by a
:class:`~.plan.Key`; received data gets a fresh buffer (nothing the loop still sends is overwritten)
and every buffer is dropped after its last use, so a ring holds two travelling blocks and a direct
schedule as many as its step needs. A nested plan (:class:`~.plan.Nested`, the two-level ring) runs
this same loop inside the compute of an outer one.

The pass plugs in ``compute(pair, data) -> [(key, contribution)]`` and an :class:`Accs`; a
contribution is a :class:`Partial` (one kernel call's result for some rows of the key's
accumulator) or a :class:`Whole` (a complete accumulator: an inner plan's result).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Protocol, Union

import torch

from ..comm.trace import now_ns
from .plan import SIDES, AnyPlan, Key, Nested, Pair, Plan

Payload = tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class Partial:
    """One kernel call's result for rows ``rows`` of an accumulator (forward: ``(out_j, lse_j)``;
    backward: ``(dq_j,)`` or ``(dk_j, dv_j)``)."""

    rows: slice
    tensors: Payload


@dataclass(frozen=True)
class Whole:
    """A complete accumulator (an inner plan's result) to fold in."""

    acc: Payload


Contribution = Union[Partial, Whole]
Compute = Callable[[Pair, dict], Iterable[tuple[Key, Contribution]]]


class Accs(Protocol):
    """How a pass accumulates (``side``: ``"q"`` or ``"kv"``; an accumulator is a tuple of tensors)."""

    sides: frozenset

    def fold(self, side: str, acc: Optional[Payload], contribution: Contribution) -> Payload:
        """``acc`` (``None``: none yet) plus a contribution."""

    def wire(self, side: str, acc: Optional[Payload]) -> Payload:
        """The tensors sent for ``acc`` (``None``: an empty one)."""

    def like(self, side: str) -> Payload:
        """Receive buffers for one accumulator of ``side``."""

    def received(self, side: str, acc: Optional[Payload], bufs: Payload) -> Payload:
        """``acc`` plus a received accumulator."""


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
            last[Key("q", pr.q)] = last[Key("kv", pr.k)] = i
        for mv in st.fetch:
            if mv.send:
                last[mv.key] = i
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
            acc[key] = accs.received(key.side, acc.get(key), bufs)
        self.taking, self.sending, self.channels = {}, [], []


def run_plan(comm, plan: AnyPlan, data: dict, compute: Compute, accs: Accs, like: Optional[Callable] = None) -> dict:
    """Run ``plan`` (a :class:`~.plan.Plan`; or a :class:`~.plan.Nested` with ``comm`` holding
    ``.inner`` and ``.outer`` transports, :class:`~burstattn.comm.transport.TwoLevel`).

    Args:
        comm: the :class:`~burstattn.comm.transport.Transport` of the plan's group (``None``: no
            transfers: one rank, or a plan that moves nothing).
        data: ``Key -> payload`` (a tuple of tensors) of the data held at the start (the plan's
            ``own``); the loop drops its references after their last use.
        compute: ``compute(pair, data) -> iterable of (key, contribution)``.
        like: ``like(key) -> payload``: receive buffers for another owner's data (default: shaped
            like this rank's own of that side; owners whose shards differ need their own).
    Returns the accumulators left on this rank, ``Key -> acc`` (its own, and for plans that keep
    partials of other owners, e.g. after an all-gather, theirs).
    """
    if isinstance(plan, Nested):
        return _run_nested(comm, plan, data, compute, accs, like)
    if comm is not None:
        comm.open_channels(plan.channels.all())
    last = _last_uses(plan)
    if like is None:
        shapes = {key.side: [(x.shape, x.dtype, x.device) for x in data[key]] for key in plan.own if key in data}

        def like(key: Key) -> Payload:
            return tuple(torch.empty(s, dtype=dt, device=dev) for s, dt, dev in shapes[key.side])
    acc: dict = {}
    flight = _Flight()
    channels = plan.channels
    for i, st in enumerate(plan.steps):
        incoming = []
        for side in SIDES:
            moves = [mv for mv in st.fetch if mv.side == side]
            bufs = []
            for mv in moves:
                if mv.send:
                    bufs.append(data[mv.key])
                else:  # a fresh buffer: the block this rank is sending is never overwritten
                    bufs.append(like(mv.key))
                    incoming.append((mv.key, bufs[-1]))
            if moves:
                _post(comm, channels.data(side), moves, bufs, st.index)
        t0 = now_ns()
        deferred = []
        for pr in st.pairs:
            for key, c in compute(pr, data):
                if key in flight.taking:  # its accumulator is still on the way here
                    deferred.append((key, c))
                else:
                    acc[key] = accs.fold(key.side, acc.get(key), c)
        if comm is not None and comm.trace is not None:
            label = channels.data(st.fetch[0].side) if st.fetch else channels.kv
            comm.trace.record("compute", comm.phase, label, st.index, comm.rank, t0, now_ns())
        flight.land(comm, accs, acc, st.index)
        for key, c in deferred:
            acc[key] = accs.fold(key.side, acc.get(key), c)
        gives = [mv for mv in st.give if mv.side in accs.sides]
        for side in SIDES:
            moves = [mv for mv in gives if mv.side == side]
            bufs = []
            for mv in moves:
                if mv.send:
                    bufs.append(accs.wire(side, acc.pop(mv.key, None)))
                    flight.sending.append(bufs[-1])
                else:
                    bufs.append(accs.like(side))
                    flight.taking[mv.key] = bufs[-1]
            if moves:
                _post(comm, channels.acc(side), moves, bufs, st.index)
                flight.channels.append(channels.acc(side))
        for side in SIDES:
            if any(mv.side == side for mv in st.fetch):
                comm.wait(channels.data(side), st.index)
        for key, bufs in incoming:
            data[key] = bufs
        for key in [k for k in data if last.get(k, -1) <= i]:
            del data[key]
    flight.land(comm, accs, acc, len(plan.steps))
    return acc


def _run_nested(levels, plan: Nested, data: dict, compute: Compute, accs: Accs, like) -> dict:
    """The outer ring's step d computes by running ``plan.inner[d]`` on the block it holds; the inner
    ring's accumulators come back as :class:`Whole` contributions of that step."""
    inner_comm = levels.inner if levels is not None else None
    outer_comm = levels.outer if levels is not None else None
    step_of = {(pr.q, pr.k): d for d, st in enumerate(plan.outer.steps) for pr in st.pairs}

    def outer_compute(pair: Pair, outer_data: dict):
        inner = plan.inner[step_of[(pair.q, pair.k)]]
        res = run_plan(inner_comm, inner, {key: outer_data[key] for key in inner.own}, compute, accs, like)
        return [(key, Whole(a)) for key, a in res.items()]

    return run_plan(outer_comm, plan.outer, data, outer_compute, accs, like)

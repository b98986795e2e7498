"""The log-depth prefix scan of the segments' summaries over point-to-point rounds (pure planning).

A *run* is a maximal stretch of consecutive positions on one rank (``zigzag``: two per rank;
``contiguous``: one). Each run's summary is the affine map ``S -> A S + B`` of its segments
composed (from the last document start inside it, if any: then the map is a constant, flagged).
The state entering run ``e`` is the composition of runs ``0 .. e - 1`` (restarting at document
starts): an exclusive prefix scan with the *segmented* operator

    (A1, B1, f1) then (A2, B2, f2) = (A2, B2, True) if f2 else (A2 A1, A2 B1 + B2, f1),

which is associative. Hillis-Steele (the log-depth scan maxtext uses for the same reason): in
round ``k`` (distance ``d = 2^k``) run ``e`` takes run ``e - d``'s value and composes it before
its own, so after ``ceil(log2 E)`` rounds every run holds its inclusive prefix; a last *shift*
hands run ``e - 1``'s prefix (a plain state) to run ``e``. Each rank holds its own runs' values
and what it received (``O(log P)`` summaries per run for the backward) instead of all ``P`` ranks'
summaries.

Everything is known on every rank from the segment plan (layout and ``cu_seqlens``), so message
sizes agree without a round trip, and moves nobody reads are pruned: a run whose value is
already flagged (it starts from a document start) takes nothing, and a value no later round or
the shift reads is not sent. With packed documents that cut every run, nothing travels.
"""
from __future__ import annotations

from dataclasses import dataclass

from .segments import SegmentPlan


@dataclass(frozen=True)
class Round:
    """One round of the scan: every move ``(src, dst, full)`` sends run ``src``'s current value to
    run ``dst``'s owner, which composes it before its own; ``full``: the value still carries its
    transition ``A`` (it does not start from a document start), else only its state ``B``."""

    distance: int
    moves: tuple


@dataclass(frozen=True)
class ScanPlan:
    """The scan of one segment plan.

    Attributes:
        owner: per run (global position order), the rank holding it.
        slots: per run, its segments' slots on the owner, in position order.
        needs_in: per run, whether its first segment continues a document from the run before.
        rounds: the rounds with at least one move, in order.
        shift: ``(src, dst)`` pairs of the last step: run ``dst`` receives run ``src = dst - 1``'s prefix state.
        needed: the runs whose own value (before any round) is read.
        final_run: the run holding position ``N - 1`` (its prefix is the final state).
    """

    owner: tuple
    slots: tuple
    needs_in: tuple
    rounds: tuple
    shift: tuple
    needed: frozenset
    final_run: int

    def runs_of(self, rank: int) -> list:
        """The runs ``rank`` holds, in position order."""
        return [e for e, r in enumerate(self.owner) if r == rank]


def _runs(seg: SegmentPlan) -> list:
    """``(start position, rank, slots)`` of every run, in position order."""
    runs = []
    for r, last in enumerate(seg.run_last):
        slots = []
        for i, is_last in enumerate(last.tolist()):
            slots.append(i)
            if is_last:
                runs.append((int(seg.starts[r][slots[0]]), r, tuple(slots)))
                slots = []
    return sorted(runs)


def scan_plan(seg: SegmentPlan, final: bool = False) -> ScanPlan:
    """The :class:`ScanPlan` of ``seg``; ``final``: the final state (run ``E - 1``'s prefix) is read too."""
    runs = _runs(seg)
    owner = tuple(r for _, r, _ in runs)
    slots = tuple(s for _, _, s in runs)
    resets = [[bool(seg.resets[owner[e]][i]) for i in slots[e]] for e in range(len(runs))]
    return plan_runs(owner, slots, tuple(any(r) for r in resets), tuple(not r[0] for r in resets), final)


def zigzag_runs(world_size: int) -> tuple:
    """``(owner, flags, needs_in)`` of the runs under ``zigzag`` with one document: ranks
    ``0 .. P - 1`` then ``P - 2 .. 0`` (rank ``P - 1``'s two chunks are one run), only run 0 resets."""
    owner = tuple(range(world_size)) + tuple(range(world_size - 2, -1, -1))
    E = len(owner)
    return owner, tuple(e == 0 for e in range(E)), tuple(e > 0 for e in range(E))


def plan_runs(owner: tuple, slots: tuple, flags: tuple, needs_in: tuple, final: bool = False) -> ScanPlan:
    """The :class:`ScanPlan` of runs given by their owners, slots, whether each contains a document
    start (``flags``; run 0 always does) and whether each continues the run before (``needs_in``)."""
    E = len(owner)
    flags = [list(flags)]
    d = 1
    while d < E:  # flags[k][e]: run e's value after k rounds starts from a document start
        prev = flags[-1]
        flags.append([prev[e] or (e >= d and prev[e - d]) for e in range(E)])
        d *= 2
    need = {e - 1 for e in range(E) if needs_in[e]} | ({E - 1} if final else set())
    rounds = []
    for k in reversed(range(len(flags) - 1)):  # backwards: which values each round must have
        d = 1 << k
        moves = tuple((e - d, e, not flags[k][e - d]) for e in sorted(need) if e >= d and not flags[k][e])
        need |= {s for s, _, _ in moves}
        if moves:
            rounds.append(Round(d, moves))
    rounds.reverse()
    shift = tuple((e - 1, e) for e in range(E) if needs_in[e])
    return ScanPlan(tuple(owner), tuple(slots), tuple(needs_in), tuple(rounds), shift, frozenset(need), E - 1)


def scan_traffic(plan: ScanPlan, world_size: int) -> list:
    """Per rank, per step it takes part in (rounds, then the shift), ``(sent, received)`` as counts
    of ``(full values, states)`` (one pass over the moves)."""
    steps = [r.moves for r in plan.rounds] + [tuple((s, d, False) for s, d in plan.shift)]
    out = [[] for _ in range(world_size)]
    for moves in steps:
        row = {}
        for src, dst, full in moves:
            a, b = plan.owner[src], plan.owner[dst]
            if a != b:
                row.setdefault(a, [[0, 0], [0, 0]])[0][0 if full else 1] += 1
                row.setdefault(b, [[0, 0], [0, 0]])[1][0 if full else 1] += 1
        for r, (sent, recv) in sorted(row.items()):
            out[r].append((tuple(sent), tuple(recv)))
    return out

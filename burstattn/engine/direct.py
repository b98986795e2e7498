"""Direct schedules: data goes straight from its owner to the rank that computes with it, partial
results straight back (DistFlashAttn, the sparse schedule of masks and partitions, pass-Q continuation).

A direct schedule is a tuple of :class:`DirectStep` per rank (pure data); :func:`direct` turns it
into a :class:`~.plan.Plan` for the one loop: the data a step needs is fetched one step ahead from
its owner, a helper's partial goes back to the queries' owner after the step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .pairs import BlockOp, MaskKind, OpsOf
from .plan import DIRECT, Channels, Key, Move, Pair, Plan, Step, ring_source


@dataclass(frozen=True)
class DirectStep:
    """One step of a direct schedule for one rank.

    Attributes:
        step: step index (0 is the rank's own diagonal block).
        own_k: compute this rank's queries against the K/V of ``own_k`` (received from it,
            or local when ``own_k == rank``); ``None``: no such work.
        helper_q: compute the queries of ``helper_q`` (received from it) against this rank's
            K/V and send the partial result back; ``None``: no helper work.
        kv_to: the rank that computes with this rank's K/V at this step (send them to it).
        q_to: the rank that computes this rank's queries at this step as a helper.
        own_part, helper_part: ``(i, parts)``: only query rows ``[i*n/parts, (i+1)*n/parts)`` of
            that work (``None``: all rows). The helper's result still covers every row (the
            others with LSE ``-inf``, which the merge ignores).
    """

    step: int
    own_k: Optional[int]
    helper_q: Optional[int]
    kv_to: Optional[int]
    q_to: Optional[int]
    own_part: Optional[tuple[int, int]] = None
    helper_part: Optional[tuple[int, int]] = None


def distflash_steps(rank: int, world_size: int) -> tuple[DirectStep, ...]:
    """DistFlashAttn's load-balanced causal schedule over the contiguous layout (pure).

    Step 0: every rank computes its causal diagonal block. Step t = 1 .. P//2: rank r >= t
    computes Q_r x K_(r-t) with K/V sent directly by rank r-t; a rank r < t would be idle,
    so (while 2t < P) it helps the overloaded rank r+P-t: it receives Q_(r+P-t), computes it
    against its own K_r and returns the partial (output, LSE) for rank r+P-t to merge. Step t
    thus covers the block distances t and P-t, and steps 1..P//2 cover every pair (i, j < i)
    exactly once. For even P the last step (t = P/2) has one distance only: rank r >= P/2
    computes the first half of Q_r's rows against K_(r-P/2) and rank r-P/2 the second half
    against its own K/V, so every rank does half a block there. Every rank then does the same
    work, P/2 blocks (the causal half of the P x P block matrix, P^2/2 blocks, spread evenly):
    the causal run takes about half the time of the non-causal ring.
    """
    steps = [DirectStep(0, rank, None, None, None)]
    half = world_size // 2
    for t in range(1, half + 1):
        if 2 * t == world_size:  # last step, even P: split Q_(r+t) x K_r between ranks r+t and r
            late = rank >= t
            steps.append(DirectStep(
                step=t, own_k=rank - t if late else None, helper_q=None if late else rank + t,
                kv_to=None if late else rank + t, q_to=rank - t if late else None,
                own_part=(0, 2) if late else None, helper_part=None if late else (1, 2)))
            continue
        steps.append(DirectStep(
            step=t,
            own_k=rank - t if rank >= t else None,
            helper_q=rank + world_size - t if rank < t else None,
            kv_to=rank + t if rank + t < world_size else None,
            q_to=rank - (world_size - t) if rank >= world_size - t else None))
    return tuple(steps)


def pass_q_steps(rank: int, world_size: int) -> tuple[DirectStep, ...]:
    """Pass-Q continuation (pure): step 0 this rank's new queries against its own cache shard; step
    t = 1 .. P-1 its queries go to rank r+t, which returns their partial, while it attends the queries
    of ``ring_source(r, t, P)`` to its own shard and sends theirs back. Every rank's queries meet
    every shard once; the cache never moves."""
    steps = [DirectStep(0, rank, None, None, None)]
    for t in range(1, world_size):
        steps.append(DirectStep(t, None, ring_source(rank, t, world_size), None, (rank + t) % world_size))
    return tuple(steps)


def sparse_steps(rank: int, world_size: int, ops_of: OpsOf, travelling: str) -> tuple[DirectStep, ...]:
    """The sparse direct schedule of ``rank`` (pure), derived from the non-empty pairs of ``ops_of``
    (rank r needs the K/V of rank s only if ``ops_of(r, s)`` has ops): any producer's, a mask's block
    summary or the dense :func:`~.pairs.position_ops` (then every pair is needed).

    Instead of relaying every block around a ring, the travelling side goes straight from its owner to
    the rank that needs it: ``travelling="kv"`` (the forward, RingAttention's backward): at step t the
    K/V of ``ring_source(r, t, P)`` come to rank r and r's go to ``r + t``; ``"q"`` (BurstAttention's
    backward): r's queries go to ``r - t`` (whose keys they see) and those of ``r + t`` come to meet r's
    keys. Step 0 is the rank's own pair. A step at which rank r neither receives nor sends is dropped
    from r's schedule, so a sliding window over the contiguous layout takes 2 steps instead of P and
    documents inside one rank take 1. Each rank reads only its row (``ops_of(r, s)``) and column
    (``ops_of(s, r)``) of pairs: both ends of every transfer derive it from the same pure function."""
    if travelling not in ("kv", "q"):
        raise ValueError(f"travelling must be 'kv' or 'q', got {travelling!r}")
    r, p = rank, world_size
    row = [bool(ops_of(r, s)) for s in range(p)]  # r's queries see s's keys
    col = [bool(ops_of(s, r)) for s in range(p)]  # s's queries see r's keys
    steps = [DirectStep(0, r if row[r] else None, None, None, None)]
    for t in range(1, p):
        ahead, behind = (r + t) % p, ring_source(r, t, p)
        if travelling == "kv":  # K/V come from r - t, go to r + t
            st = DirectStep(t, behind if row[behind] else None, None, ahead if col[ahead] else None, None)
        else:  # queries come from r + t, go to r - t
            st = DirectStep(t, None, ahead if col[ahead] else None, None, behind if row[behind] else None)
        if (st.own_k, st.helper_q, st.kv_to, st.q_to) != (None, None, None, None):
            steps.append(st)
    return tuple(steps)


def part_rows(part: Optional[tuple[int, int]], n: int) -> slice:
    """The query rows of a :class:`DirectStep` part for ``n`` local rows (``None``: all)."""
    if part is None:
        return slice(0, n)
    i, parts = part
    return slice(i * n // parts, (i + 1) * n // parts)


def _rows(ops: tuple[BlockOp, ...], part: Optional[tuple[int, int]], n: int) -> tuple[BlockOp, ...]:
    """``ops`` cut to the query rows of a part (``None``: all)."""
    if part is None:
        return ops
    rows = part_rows(part, n)
    out = []
    for op in ops:
        a, b = max(op.q_start, rows.start), min(op.q_stop, rows.stop)
        if a >= b:
            continue
        if (a, b) != (op.q_start, op.q_stop) and op.mask in (MaskKind.CAUSAL, MaskKind.STRICT):
            raise ValueError(f"cannot cut the square {op.mask.value} op {op} to rows [{a}, {b})")
        out.append(BlockOp(a, b, op.k_start, op.k_stop, op.mask))
    return tuple(out)


def direct(rank: int, steps: tuple[DirectStep, ...], world_size: int, ops_of: OpsOf, n_rows: int,
           channels: Channels = DIRECT) -> Plan:
    """The :class:`~.plan.Plan` of a direct schedule: data the step needs is fetched one step ahead
    from its owner, partials go straight back (``n_rows``: this rank's query rows, for parts)."""
    r = rank
    out = []
    for i, st in enumerate(steps):
        pairs = []
        if st.own_k is not None:
            pairs.append(Pair(r, st.own_k, _rows(ops_of(r, st.own_k), st.own_part, n_rows)))
        if st.helper_q is not None:
            pairs.append(Pair(st.helper_q, r, _rows(ops_of(st.helper_q, r), st.helper_part, n_rows)))
        fetch = _moves(r, steps[i + 1], partials=False) if i + 1 < len(steps) else ()
        out.append(Step(st.step, tuple(pairs), fetch, _moves(r, st, partials=True)))
    return Plan(r, world_size, (Key("kv", r), Key("q", r)), tuple(out), channels)


def _moves(r: int, st: DirectStep, partials: bool) -> tuple[Move, ...]:
    """The exchanges of a step, per side: another owner's block held here (``own_k``'s K/V, ``helper_q``'s
    queries) and the rank this rank's own block goes to (``kv_to``, ``q_to``). The data (``partials``
    false, fetched the step before) comes from the holder's owner and goes out to that rank; the partial
    results (``partials`` true) go back to the owner and come home from that rank."""
    out = []
    for side, held, to in (("kv", st.own_k if st.own_k != r else None, st.kv_to), ("q", st.helper_q, st.q_to)):
        mine = () if to is None else (Move(side, r, to, not partials),)
        theirs = () if held is None else (Move(side, held, held, partials),)
        out += [*theirs, *mine] if partials else [*mine, *theirs]
    return tuple(out)

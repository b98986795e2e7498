"""Plans: what one rank computes and moves at every step of the one loop (pure data, no process group).

A :class:`Plan` is a list of :class:`Step` for one rank. A step computes some :class:`Pair` s (the
queries of one owner against the keys of another, as block ops) and moves data (:class:`Move`):

* ``fetch``: travelling data (``"kv"``: packed K/V; ``"q"``: the query side) for the *next* step,
  posted before this step computes and waited for after it (the double buffer);
* ``give``: accumulators (``"q"``: the output and LSE forward, dQ backward; ``"kv"``: dK/dV), posted
  after this step's fold and waited for before the next step's fold.

Owners are global ranks (whose queries / keys a tensor holds); peers are ranks of the loop's process
group. Every schedule is such a list: the ring (data relayed one hop per step, the accumulator one
step behind it, home after the last hop), the direct schedules (DistFlashAttn, masks: data straight
from its owner, partials straight back) and, nested, the two-level ring. The pairs come from the
queries' and keys' global positions (:func:`ops_from_positions`), so shards of different lengths
(decoding, continuation) are plans like any other.

:func:`check_plans` verifies a set of plans (one per rank) without a process group: every needed
pair computed exactly once, every send met by a receive of the same data on its peer in the same
step, every piece of data present where it is used.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional

from .schedule import BlockOp, DirectStep, MaskKind, position_ops

OpsOf = Callable[[int, int], tuple[BlockOp, ...]]  # (query owner, key owner) -> block ops


@dataclass(frozen=True)
class Pair:
    """Queries of owner ``q`` against keys of owner ``k`` (global ranks), as ``ops``."""

    q: int
    k: int
    ops: tuple[BlockOp, ...]


@dataclass(frozen=True)
class Move:
    """One transfer of the ``side`` (``"kv"`` or ``"q"``) data or accumulator of ``owner``, sent
    to (``send``) or received from ``peer`` (a rank of the loop's group)."""

    side: str
    owner: int
    peer: int
    send: bool


@dataclass(frozen=True)
class Step:
    """One step: compute ``pairs``; post ``fetch`` (data for the next step) and ``give``
    (accumulators). ``index`` labels the step in traces."""

    index: int
    pairs: tuple[Pair, ...] = ()
    fetch: tuple[Move, ...] = ()
    give: tuple[Move, ...] = ()


@dataclass(frozen=True)
class Plan:
    """The steps of one rank; ``own``: the ``(side, owner)`` data it starts with; ``labels``: the
    channel (and byte-meter op) of each ``("data" | "acc", side)``."""

    rank: int
    world_size: int
    own: tuple[tuple[str, int], ...]
    steps: tuple[Step, ...]
    labels: dict = field(default_factory=dict)

    def channels(self) -> list[str]:
        """Every channel label, in a fixed order (the same on every rank: tags match)."""
        return sorted(set(self.labels.values()))


RING_LABELS = {("data", "kv"): "kv", ("data", "q"): "q", ("acc", "kv"): "dkv", ("acc", "q"): "dq"}
DIRECT_LABELS = {("data", "kv"): "kv", ("data", "q"): "q", ("acc", "kv"): "ret_kv", ("acc", "q"): "ret_q"}


def ring(rank: int, world_size: int, ops_of: OpsOf, travelling: str, *, owners: Optional[list[int]] = None,
         home: Optional[int] = None, labels: Optional[dict] = None) -> Plan:
    """The ring: at step t rank r holds the ``travelling`` block of ``owners[(r - t) mod P]`` (sent
    on to r+1, the next one received from r-1) and, one step behind, its accumulator.

    ``owners`` maps ring positions to global owners (default: the identity); ``home`` owns the side
    that stays (default ``owners[rank]``; the inner ring of the two-level schedule circulates blocks
    its ranks hold for others).
    """
    p = world_size
    owners = list(range(p)) if owners is None else owners
    other = "q" if travelling == "kv" else "kv"
    me = owners[rank] if home is None else home
    steps = []
    for t in range(p):
        src, nxt = owners[(rank - t) % p], owners[(rank - t - 1) % p]
        qo, ko = (me, src) if travelling == "kv" else (src, me)
        fetch = ((Move(travelling, src, (rank + 1) % p, True), Move(travelling, nxt, (rank - 1) % p, False))
                 if t < p - 1 else ())
        give = (Move(travelling, src, (rank + 1) % p, True), Move(travelling, nxt, (rank - 1) % p, False)) if p > 1 else ()
        steps.append(Step(t, (Pair(qo, ko, ops_of(qo, ko)),), fetch, give))
    own = ((travelling, owners[rank]), (other, me))
    return Plan(rank, p, own, tuple(steps), labels or RING_LABELS)


def _rows(ops: tuple[BlockOp, ...], part: Optional[tuple[int, int]], n: int) -> tuple[BlockOp, ...]:
    """``ops`` cut to the query rows of a :class:`~.schedule.DirectStep` part (``None``: all)."""
    if part is None:
        return ops
    i, parts = part
    lo, hi = i * n // parts, (i + 1) * n // parts
    out = []
    for op in ops:
        a, b = max(op.q_start, lo), min(op.q_stop, hi)
        if a >= b:
            continue
        if (a, b) != (op.q_start, op.q_stop) and op.mask in (MaskKind.CAUSAL, MaskKind.STRICT):
            raise ValueError(f"cannot cut the square {op.mask.value} op {op} to rows [{a}, {b})")
        out.append(BlockOp(a, b, op.k_start, op.k_stop, op.mask))
    return tuple(out)


def direct(rank: int, steps: tuple[DirectStep, ...], world_size: int, ops_of: OpsOf, n_rows: int,
           labels: Optional[dict] = None) -> Plan:
    """A direct schedule (:class:`~.schedule.DirectStep` s, as DistFlashAttn's and the masks'):
    data the step needs is fetched one step ahead from its owner, partials go straight back."""
    r = rank
    out = []
    for i, st in enumerate(steps):
        pairs = []
        if st.own_k is not None:
            pairs.append(Pair(r, st.own_k, _rows(ops_of(r, st.own_k), st.own_part, n_rows)))
        if st.helper_q is not None:
            pairs.append(Pair(st.helper_q, r, _rows(ops_of(st.helper_q, r), st.helper_part, n_rows)))
        give = []
        if st.own_k is not None and st.own_k != r:
            give.append(Move("kv", st.own_k, st.own_k, True))
        if st.kv_to is not None:
            give.append(Move("kv", r, st.kv_to, False))
        if st.helper_q is not None:
            give.append(Move("q", st.helper_q, st.helper_q, True))
        if st.q_to is not None:
            give.append(Move("q", r, st.q_to, False))
        fetch = []
        if i + 1 < len(steps):
            nx = steps[i + 1]
            if nx.kv_to is not None:
                fetch.append(Move("kv", r, nx.kv_to, True))
            if nx.own_k is not None and nx.own_k != r:
                fetch.append(Move("kv", nx.own_k, nx.own_k, False))
            if nx.q_to is not None:
                fetch.append(Move("q", r, nx.q_to, True))
            if nx.helper_q is not None:
                fetch.append(Move("q", nx.helper_q, nx.helper_q, False))
        out.append(Step(st.step, tuple(pairs), tuple(fetch), tuple(give)))
    return Plan(r, world_size, (("kv", r), ("q", r)), tuple(out), labels or DIRECT_LABELS)


def local(rank: int, owners: list[int], ops_of: OpsOf) -> Plan:
    """One step, no transfers: this rank's queries against every owner's keys (all held here,
    as after an all-gather); the accumulators of the other owners stay here too."""
    pairs = tuple(Pair(rank, k, ops_of(rank, k)) for k in owners)
    return Plan(rank, 1, (("q", rank),) + tuple(("kv", k) for k in owners), (Step(0, pairs),), {})


def ops_from_positions(q_pos: list, k_pos: list, causal: bool) -> OpsOf:
    """``ops_of(q_owner, k_owner)`` from each owner's global query and key positions (lists of
    ``[n_i]`` integer tensors, any lengths); each pair is computed once, on first use."""
    cache: dict = {}

    def ops_of(q: int, k: int) -> tuple[BlockOp, ...]:
        if (q, k) not in cache:
            cache[(q, k)] = position_ops(q_pos[q], k_pos[k], causal)
        return cache[(q, k)]
    return ops_of


def needed(ops_of: OpsOf, world_size: int) -> set[tuple[int, int]]:
    """Every (query owner, key owner) pair with at least one block op."""
    return {(q, k) for q in range(world_size) for k in range(world_size) if ops_of(q, k)}


def check_plans(plans: list[Plan], ops_of: OpsOf, sides: tuple[str, ...] = ("q", "kv")) -> None:
    """Raise ``AssertionError`` unless the plans (``plans[i]`` of group rank i) are consistent.

    Checks: every needed pair (:func:`needed`, over the plans' owners) is computed exactly once,
    with ``ops_of``'s ops (rows cut by direct parts allowed); every send of a step is met by a
    receive of the same side and owner on its peer at the same step, both for data and for the
    accumulators of ``sides``; every pair finds its data where it runs (``plans[i]`` is group
    rank i; owners are the ranks of the ``own`` data).
    """
    owners = sorted({o for p in plans for _, o in p.own})
    rows: dict = {}
    for p in plans:
        for st in p.steps:
            for pr in st.pairs:
                if pr.ops:
                    rows.setdefault((pr.q, pr.k), []).extend(pr.ops)
    want = {(q, k) for q in owners for k in owners if ops_of(q, k)}
    assert set(rows) == want, f"computed pairs {sorted(rows)} != needed {sorted(want)}"
    for pair, ops in rows.items():  # each (query row, key range) exactly once
        assert _rows_join(ops) == _rows_join(ops_of(*pair)), f"pair {pair}: ops {ops} != {ops_of(*pair)}"
    for kind in ("fetch", "give"):
        n_steps = max(len(p.steps) for p in plans)
        for t in range(n_steps):
            sends, recvs = Counter(), Counter()
            for i, p in enumerate(plans):
                st = p.steps[t] if t < len(p.steps) else Step(t)
                for mv in getattr(st, kind):
                    if kind == "give" and mv.side not in sides:
                        continue
                    (sends if mv.send else recvs)[(i, mv.peer, mv.side, mv.owner) if mv.send
                                                  else (mv.peer, i, mv.side, mv.owner)] += 1
            assert sends == recvs, f"{kind} step {t}: sends {dict(sends)} != receives {dict(recvs)}"
    for i, p in enumerate(plans):
        held = set(p.own)
        for st in p.steps:
            for pr in st.pairs:
                assert ("q", pr.q) in held and ("kv", pr.k) in held, f"rank {i} step {st.index}: {pr} not held"
            for mv in st.fetch:
                if mv.send:
                    assert (mv.side, mv.owner) in held, f"rank {i} step {st.index} sends {mv} not held"
            held |= {(mv.side, mv.owner) for mv in st.fetch if not mv.send}


def _rows_join(ops) -> list:
    """Ops with row spans cut by direct parts joined back (a duplicate span stays separate)."""
    by_k: dict = {}
    for o in ops:
        by_k.setdefault((o.k_start, o.k_stop, o.mask), []).append((o.q_start, o.q_stop))
    out = []
    for key, spans in sorted(by_k.items()):
        spans.sort()
        merged = [list(spans[0])]
        for a, b in spans[1:]:
            if a == merged[-1][1]:
                merged[-1][1] = b
            else:
                merged.append([a, b])
        out.extend((a, b) + key for a, b in merged)
    return sorted(out)

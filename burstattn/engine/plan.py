"""Plans: what one rank computes and moves at every step of the one loop (pure data, no process group).

A :class:`Plan` is a list of :class:`Step` for one rank. A step computes some :class:`Pair` s (the
queries of one owner against the keys of another, as block ops of :mod:`.pairs`) and moves data
(:class:`Move`):

* ``fetch``: travelling data (side ``"kv"``: packed K/V; ``"q"``: the query side) for the *next*
  step, posted before this step computes and waited for after it (the double buffer);
* ``give``: accumulators (``"q"``: the output and LSE forward, dQ backward; ``"kv"``: dK/dV),
  posted after this step's fold and waited for before the next step's fold.

Data and accumulators are named by a :class:`Key` (side, owner). Owners are global ranks (whose
queries / keys a tensor holds); peers are ranks of the loop's process group. Every schedule is such
a list: the ring (:func:`ring`: data relayed one hop per step, the accumulator one step behind it,
home after the last hop), the direct schedules (:mod:`.direct`: DistFlashAttn, masks, pass-Q
continuation: data straight from its owner, partials straight back), one step without transfers
(:func:`local`: after an all-gather, a decode step) and, nested, the two-level ring
(:func:`two_level`). The pairs come from the queries' and keys' global positions
(:func:`~.pairs.ops_from_positions`), so shards of different lengths (decoding, continuation) are
plans like any other.

:func:`check_plans` verifies a set of plans (one per rank) without a process group: every needed
pair computed exactly once, every send met by a receive of the same data on its peer in the same
step, every piece of data present where it is used. :func:`plan_cost` is a plan's work.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import NamedTuple, Optional, Union

from .pairs import BlockOp, OpsOf

SIDES = ("kv", "q")


class Key(NamedTuple):
    """A piece of data or an accumulator: its ``side`` (``"kv"`` or ``"q"``) and its ``owner``."""

    side: str
    owner: int


@dataclass(frozen=True)
class Pair:
    """Queries of owner ``q`` against keys of owner ``k`` (global ranks), as ``ops``."""

    q: int
    k: int
    ops: tuple[BlockOp, ...]


@dataclass(frozen=True)
class Move:
    """One transfer of the ``side`` data or accumulator of ``owner``, sent to (``send``) or received
    from ``peer`` (a rank of the loop's group)."""

    side: str
    owner: int
    peer: int
    send: bool

    @property
    def key(self) -> Key:
        return Key(self.side, self.owner)


@dataclass(frozen=True)
class Step:
    """One step: compute ``pairs``; post ``fetch`` (data for the next step) and ``give``
    (accumulators). ``index`` labels the step in traces."""

    index: int
    pairs: tuple[Pair, ...] = ()
    fetch: tuple[Move, ...] = ()
    give: tuple[Move, ...] = ()


@dataclass(frozen=True)
class Channels:
    """The channel (and byte-meter op) of each stream: the travelling data of each side, and each
    side's accumulator."""

    kv: str = "kv"
    q: str = "q"
    dkv: str = "dkv"
    dq: str = "dq"

    def data(self, side: str) -> str:
        return self.kv if side == "kv" else self.q

    def acc(self, side: str) -> str:
        return self.dkv if side == "kv" else self.dq

    def all(self) -> list[str]:
        """Every channel, in a fixed order (the same on every rank: tags match)."""
        return sorted({self.kv, self.q, self.dkv, self.dq})


RING = Channels()
DIRECT = Channels(dkv="ret_kv", dq="ret_q")
OUTER = Channels("kv_outer", "q_outer", "dkv_outer", "dq_outer")


@dataclass(frozen=True)
class Plan:
    """The steps of one rank; ``own``: the data it starts with; ``channels``: what each stream is
    called on the wire."""

    rank: int
    world_size: int
    own: tuple[Key, ...]
    steps: tuple[Step, ...]
    channels: Channels = RING


@dataclass(frozen=True)
class Nested:
    """A two-level plan: ``outer`` (over the outer group) whose step d runs ``inner[d]`` (over the
    inner group) on the block it holds."""

    outer: Plan
    inner: tuple[Plan, ...]


AnyPlan = Union[Plan, Nested]


def ring_source(rank: int, step: int, world_size: int) -> int:
    """The ring position whose travelling block sits on ``rank`` at ``step`` (blocks move r -> r+1):
    the one ring-source formula."""
    return (rank - step) % world_size


def ring(rank: int, world_size: int, ops_of: OpsOf, travelling: str, *, owners: Optional[list[int]] = None,
         home: Optional[int] = None, channels: Channels = RING) -> Plan:
    """The ring: at step t rank r holds the ``travelling`` block of ``owners[ring_source(r, t, P)]``
    (sent on to r+1, the next one received from r-1) and, one step behind, its accumulator.

    ``owners`` maps ring positions to global owners (default: the identity); ``home`` owns the side
    that stays (default ``owners[rank]``; the inner ring of the two-level schedule circulates blocks
    its ranks hold for others).
    """
    if travelling not in SIDES:
        raise ValueError(f"travelling must be 'kv' or 'q', got {travelling!r}")
    p = world_size
    owners = list(range(p)) if owners is None else owners
    other = "q" if travelling == "kv" else "kv"
    me = owners[rank] if home is None else home
    nxt_peer, prev_peer = (rank + 1) % p, (rank - 1) % p
    steps = []
    for t in range(p):
        src, nxt = owners[ring_source(rank, t, p)], owners[ring_source(rank, t + 1, p)]
        qo, ko = (me, src) if travelling == "kv" else (src, me)
        relay = (Move(travelling, src, nxt_peer, True), Move(travelling, nxt, prev_peer, False))
        steps.append(Step(t, (Pair(qo, ko, ops_of(qo, ko)),), relay if t < p - 1 else (), relay if p > 1 else ()))
    return Plan(rank, p, (Key(travelling, owners[rank]), Key(other, me)), tuple(steps), channels)


def two_level(rank: int, world_size: int, ranks_per_node: int, ops_of: OpsOf, travelling: str) -> Nested:
    """The two-level ("double") ring as a nested plan, the one builder of it.

    With P = M nodes x R ranks per node (rank ``r = m*R + i``): an *outer* ring over the ranks with
    index ``i`` on every node (one inter-node hop per outer step; at outer step d rank (m, i) holds
    the outer block of ((m-d) mod M, i)), whose step d runs an *inner* ring over the node on the
    outer blocks (at inner step s, the block of ((m-d) mod M, (i-s) mod R)). Over (d, s) every rank
    meets every block exactly once; the outer transfer has R inner steps of compute to hide behind.
    Accumulators follow both levels: each inner ring returns its partial to the rank that held the
    outer block, which folds it into the outer accumulator travelling one outer step behind.
    """
    r_, m_ = ranks_per_node, world_size // ranks_per_node
    m, i = divmod(rank, r_)
    outer = ring(m, m_, lambda q, k: (), travelling, owners=[o * r_ + i for o in range(m_)], home=rank,
                 channels=OUTER)
    inner = tuple(ring(i, r_, ops_of, travelling, owners=[ring_source(m, d, m_) * r_ + j for j in range(r_)],
                       home=rank) for d in range(m_))
    return Nested(outer, inner)


def local(rank: int, owners: list[int], ops_of: OpsOf, query_owners: Optional[list[int]] = None) -> Plan:
    """One step, no transfers: the queries of ``query_owners`` (default: this rank's) against every
    owner's keys, all held here (after an all-gather; a decode step's replicated query against this
    rank's cache shard). The accumulators of every owner stay here too."""
    qs = [rank] if query_owners is None else query_owners
    pairs = tuple(Pair(q, k, ops_of(q, k)) for q in qs for k in owners)
    return Plan(rank, 1, tuple(Key("q", q) for q in qs) + tuple(Key("kv", k) for k in owners),
                (Step(0, pairs),))


def plan_pairs(plan: AnyPlan):
    """Every pair a plan computes (a nested plan's inner pairs), in step order."""
    if isinstance(plan, Nested):
        return [pr for inner in plan.inner for st in inner.steps for pr in st.pairs]
    return [pr for st in plan.steps for pr in st.pairs]


def plan_cost(plan: AnyPlan) -> float:
    """Score entries the plan computes (the attention FLOPs up to a constant): a rank's work, the
    balance figure's input."""
    return sum(op.cost for pr in plan_pairs(plan) for op in pr.ops)


def check_plans(plans: list[Plan], ops_of: OpsOf, sides: tuple[str, ...] = SIDES) -> None:
    """Raise ``AssertionError`` unless the plans (``plans[i]`` of group rank i) are consistent.

    Checks: every needed pair (over the plans' owners) is computed exactly once, with ``ops_of``'s
    ops (rows cut by direct parts allowed); every send of a step is met by a receive of the same
    side and owner on its peer at the same step, both for data and for the accumulators of
    ``sides``; every pair finds its data where it runs.
    """
    q_owners = sorted({key.owner for p in plans for key in p.own if key.side == "q"})
    k_owners = sorted({key.owner for p in plans for key in p.own if key.side == "kv"})
    rows: dict = {}
    for p in plans:
        for pr in plan_pairs(p):
            if pr.ops:
                rows.setdefault((pr.q, pr.k), []).extend(pr.ops)
    want = {(q, k) for q in q_owners for k in k_owners if ops_of(q, k)}
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
                    (sends if mv.send else recvs)[(i, mv.peer, mv.key) if mv.send else (mv.peer, i, mv.key)] += 1
            assert sends == recvs, f"{kind} step {t}: sends {dict(sends)} != receives {dict(recvs)}"
    for i, p in enumerate(plans):
        held = set(p.own)
        for st in p.steps:
            for pr in st.pairs:
                assert Key("q", pr.q) in held and Key("kv", pr.k) in held, f"rank {i} step {st.index}: {pr} not held"
            for mv in st.fetch:
                if mv.send:
                    assert mv.key in held, f"rank {i} step {st.index} sends {mv} not held"
            held |= {mv.key for mv in st.fetch if not mv.send}


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

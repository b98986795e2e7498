"""Dynamic dispatch: every sequence of a step's global batch gets its own context-parallel degree and
group of ranks, so that every rank's estimated step cost is balanced (pure: no process group).

A step's global batch is a list of sequences of any lengths (documents of a stream, or rows). The
plan gives sequence ``i`` a degree ``d`` (a divisor of the world P: the aligned groups of degree d are
``[g d, (g + 1) d)``, created once, :func:`burstattn.comm.groups.degree_groups`) and one of the ``P / d``
groups. A rank's cost is the sum over the sequences it shares of :meth:`DispatchCost.per_rank`:

    attention  a = pairs(L) / d * pair_s      (causal pairs L (L + 1) / 2, forward + backward)
    linear     L / d * token_s                (projections, MLP, loss: per token)
    exposed    (d - 1) * max(0, hop - a / d)  (each of the d - 1 ring hops hides under one block of
               hop = hop_s + L / d * kv_bytes * byte_s    attention, or shows its excess)

``dynamic``: each sequence takes the smallest degree whose shard fits ``budget`` tokens per rank and
whose per-rank cost fits the mean rank load (short sequences on one rank, no traffic; long ones over
as many ranks as they need), then the sequences are placed heaviest first on the least loaded group
of their degree (LPT). ``static``: today's fixed ``dp x cp`` mesh: every sequence at degree ``cp``;
the ``dp`` replicas take consecutive runs of the batch with about equal tokens.

The execution order is the plan's: every rank runs its sequences in increasing plan index, so the
first unfinished sequence always has all its ranks on it (no deadlock over overlapping groups).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

MODES = ("static", "dynamic")
DISPATCH_STRATEGIES = ("burst", "ring", "allgather")  # the strategies that run at every degree with one set of options


@dataclass(frozen=True)
class DispatchCost:
    """Seconds per unit of one rank's work: ``pair_s`` per causal query-key pair (forward + backward,
    all layers), ``token_s`` per token (linear layers and loss, forward + backward), ``byte_s`` per
    byte a rank sends on the ring, ``kv_bytes`` per token per ring hop (K and V of all layers, forward
    and backward)."""

    pair_s: float
    token_s: float
    byte_s: float = 0.0
    kv_bytes: float = 0.0
    hop_s: float = 0.0
    """Fixed seconds of one ring hop, all layers and passes (latency, per-step overhead)."""

    def pairs(self, length: int) -> float:
        return length * (length + 1) / 2

    def per_rank(self, length: int, degree: int) -> float:
        """One rank's estimated seconds for a sequence of ``length`` tokens over ``degree`` ranks."""
        attn = self.pairs(length) / degree * self.pair_s
        hop = self.hop_s + length / degree * self.kv_bytes * self.byte_s
        return attn + length / degree * self.token_s + (degree - 1) * max(0.0, hop - attn / degree)

    @classmethod
    def for_model(cls, dim: int, n_layers: int, n_heads: int, n_kv_heads: int, head_dim: int, ffn_dim: int,
                  vocab_size: int, *, matmul_flops: float = 1e10, attn_flops: float = 1e10,
                  link_bytes_per_s: float = 2e9, element_size: int = 4, hop_latency_s: float = 3e-4) -> "DispatchCost":
        """The cost of a LLaMA-shaped model from its FLOPs: per pair ``4 Hq hd`` forward, 2.5x that
        backward; per token ``6 x`` the linear weights (forward + backward); per hop K and V of every
        layer, forward, and K, V, dK, dV backward, and ``hop_latency_s`` per layer and pass (3: the
        forward ring and the backward's two). Rates in FLOP/s and bytes/s (defaults: a CPU core, a
        loopback gloo link and the engine's per-step overhead on it, order of magnitude)."""
        pair = 4 * n_heads * head_dim * 3.5 * n_layers
        weights = n_layers * (dim * (n_heads + 2 * n_kv_heads) * head_dim + n_heads * head_dim * dim
                              + 3 * dim * ffn_dim) + dim * vocab_size
        kv = 2 * n_kv_heads * head_dim * element_size * n_layers * 3
        return cls(pair / attn_flops, 6 * weights / matmul_flops, 1.0 / link_bytes_per_s, kv, 3 * n_layers * hop_latency_s)


@dataclass(frozen=True)
class Placement:
    """One sequence of the plan: its index in the batch, length, degree, group index (ranks
    ``[group * degree, (group + 1) * degree)``) and per-rank cost estimate."""

    seq: int
    length: int
    degree: int
    group: int
    cost: float

    @property
    def ranks(self) -> range:
        return range(self.group * self.degree, (self.group + 1) * self.degree)


@dataclass(frozen=True)
class DispatchPlan:
    """The placements in execution order, and every rank's estimated cost."""

    world_size: int
    mode: str
    placements: tuple[Placement, ...]
    loads: tuple[float, ...]

    def of_rank(self, rank: int) -> list[Placement]:
        """The sequences ``rank`` takes part in, in execution order."""
        return [p for p in self.placements if rank in p.ranks]

    @property
    def balance(self) -> float:
        """max / mean estimated rank cost (1.0: perfect)."""
        mean = sum(self.loads) / len(self.loads)
        return max(self.loads) / mean if mean > 0 else 1.0

    @property
    def degrees(self) -> dict[int, int]:
        """How many sequences run at each degree."""
        out: dict[int, int] = {}
        for p in self.placements:
            out[p.degree] = out.get(p.degree, 0) + 1
        return dict(sorted(out.items()))


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check(lengths: Sequence[int], world_size: int, budget: Optional[int]) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not lengths:
        raise ValueError("dispatch: the global batch holds no sequence")
    bad = [v for v in lengths if isinstance(v, bool) or not isinstance(v, int) or v < 1]
    if bad:
        raise ValueError(f"dispatch: sequence lengths must be positive ints, got {bad[0]!r}")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
        raise ValueError(f"budget must be a positive int (tokens per rank), got {budget!r}")
    if budget is not None:
        longest = max(lengths)
        if longest > budget * world_size:
            raise ValueError(f"dispatch: a document of {longest} tokens exceeds the whole world's memory budget "
                             f"({world_size} ranks x {budget} tokens = {budget * world_size} tokens)")


def plan_dispatch(lengths: Sequence[int], world_size: int, cost: DispatchCost, *, mode: str = "dynamic",
                  cp: Optional[int] = None, budget: Optional[int] = None) -> DispatchPlan:
    """The :class:`DispatchPlan` of one step (module docstring).

    Args:
        lengths: the global batch's sequence lengths, in batch order.
        world_size: P.
        cost: the per-rank cost model.
        mode: ``"dynamic"`` or ``"static"``.
        cp: ``static``: the fixed context-parallel degree (a divisor of P; default P).
        budget: tokens a rank may hold of one sequence (``None``: no limit).
    Raises:
        ValueError: a bad argument; a sequence longer than ``world_size x budget`` (naming both).
    """
    _check(lengths, world_size, budget)
    if mode not in MODES:
        raise ValueError(f"dispatch must be one of {MODES}, got {mode!r}")
    if mode == "static":
        return _static(lengths, world_size, cost, world_size if cp is None else cp, budget)
    mean = sum(cost.per_rank(n, 1) for n in lengths) / world_size
    # a sequence's share must fit a fraction of a rank's fair load: the coarser the fraction, the
    # fewer rings (traffic) but the harder to pack; the best of a few, by the slowest rank
    plans = [_dynamic(lengths, world_size, cost, budget, mean * f) for f in THRESHOLDS]
    return min(plans, key=lambda p: (max(p.loads), -p.degrees.get(1, 0)))


THRESHOLDS = (1.0, 0.5, 0.25, 0.125, 0.0625)


def _dynamic(lengths: Sequence[int], world_size: int, cost: DispatchCost, budget: Optional[int],
             share: float) -> DispatchPlan:
    """Degrees: the smallest whose share fits ``share`` (and the budget); LPT placement."""
    degrees = divisors(world_size)
    chosen = []
    for n in lengths:
        fits = [d for d in degrees if budget is None or -(-n // d) <= budget]
        chosen.append(next((d for d in fits if cost.per_rank(n, d) <= share), fits[-1]))
    loads = [0.0] * world_size
    order = sorted(range(len(lengths)), key=lambda i: (-cost.per_rank(lengths[i], chosen[i]), i))
    placed = []
    for i in order:
        d, c = chosen[i], cost.per_rank(lengths[i], chosen[i])
        g = min(range(world_size // d), key=lambda g: (max(loads[g * d:(g + 1) * d]) + c, g))
        for r in range(g * d, (g + 1) * d):
            loads[r] += c
        placed.append(Placement(i, lengths[i], d, g, c))
    return DispatchPlan(world_size, "dynamic", tuple(placed), tuple(loads))


def _static(lengths: Sequence[int], world_size: int, cost: DispatchCost, cp: int,
            budget: Optional[int]) -> DispatchPlan:
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1 or world_size % cp:
        raise ValueError(f"cp must be a positive divisor of the world size {world_size}, got {cp!r}")
    if budget is not None and max(-(-n // cp) for n in lengths) > budget:
        n = max(lengths)
        raise ValueError(f"dispatch static: a document of {n} tokens over cp = {cp} ranks exceeds the budget of "
                         f"{budget} tokens per rank")
    dp, total = world_size // cp, sum(lengths)
    loads, placed, seen = [0.0] * world_size, [], 0
    for i, n in enumerate(lengths):  # consecutive runs of about total / dp tokens per replica
        g = min(dp - 1, (seen + n // 2) * dp // total)
        seen += n
        c = cost.per_rank(n, cp)
        for r in range(g * cp, (g + 1) * cp):
            loads[r] += c
        placed.append(Placement(i, n, cp, g, c))
    return DispatchPlan(world_size, "static", tuple(placed), tuple(loads))


def micro_batches(mine: list[Placement], cap: int) -> list[list[Placement]]:
    """Degree-1 sequences packed in order into runs of at most ``cap`` tokens; each other one alone."""
    out: list[list[Placement]] = []
    run, size = [], 0
    for p in mine:
        if p.degree > 1:
            out.append([p])
            continue
        if run and size + p.length > cap:
            out.append(run)
            run, size = [], 0
        run.append(p)
        size += p.length
    return out + ([run] if run else [])

"""One attention layer's timeline per strategy: the library's per-step plans replayed on a cluster.

``attention_timeline(strategy, shape, hw, ...)`` returns an :class:`AttnTimeline` for the forward
and the backward of one attention call on every rank of a context-parallel group.

Ring plans (burst, ring, rsa, usp's inner ring, the double ring) follow the one loop,
:func:`burstattn.engine.loop.run_plan`, event by event: at step ``t`` a rank posts the transfer of
the next travelling block (rendezvous: it starts when both ends have posted), computes the step's
block ops, waits for the travelling accumulator of step ``t-1`` from its predecessor, folds into it
and sends it on, then waits for the next block. The recurrence runs over all ranks at once (numpy
rows); when every rank's work is the same (balanced layouts) one row stands for all. DistFlashAttn's
direct plan follows the same loop (shifts instead of a ring, :mod:`.direct`). Collective strategies (ulysses, allgather, tp) have no overlap: collective, compute,
collective. Times split into ``compute`` (mean over ranks), ``idle`` (what imbalance adds: the same
run with free links, minus the compute) and ``exposed_comm`` (the rest).
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from . import net, plans
from .direct import distflash_strategy, window_strategy
from .hardware import ClusterHW
from .attn_timeline import AttnShape, AttnTimeline, Pass, element_sizes, kernel_seconds

__all__ = ["AttnShape", "AttnTimeline", "Pass", "attention_timeline", "SEQUENCE_STRATEGIES"]


def _ring(c: np.ndarray, m_travel: float, m_acc: Optional[float], fold: float, ring_rows: bool,
          gantt_ranks: int = 8) -> Pass:
    """The ring-loop recurrence (module docstring). ``c [ranks, steps]`` seconds; ``ring_rows``:
    row r's predecessor is row r-1 (all ranks present) - else every row is its own class."""
    if np.all(c == c[:1]):
        c, ring_rows = c[:1], False  # balanced: one rank class stands for all
    steps = c.shape[1]

    def run(mt: float, ma: Optional[float], record: bool):
        prev = (lambda x: np.roll(x, 1)) if ring_rows else (lambda x: x)
        s = np.zeros(c.shape[0])
        link = np.zeros(c.shape[0])  # when the link into each rank is free: block and accumulator share it
        acc_in, ev = None, []
        shown = range(min(gantt_ranks, len(s)))
        for t in range(steps):
            done = s + c[:, t]
            if record:
                ev += [(r, "compute", s[r], done[r]) for r in shown]
            arrive_block = None
            if t < steps - 1 and mt is not None:  # posted before the compute (both ends: a rendezvous)
                start = np.maximum(np.maximum(s, prev(s)), link)
                arrive_block = link = start + mt
                if record:
                    ev += [(r, "comm", start[r], arrive_block[r]) for r in shown]
            f = done
            if ma is not None:
                if acc_in is not None:  # the accumulator of step t-1 from the predecessor
                    f = np.maximum(done, acc_in)
                f = f + fold
                start = np.maximum(np.maximum(f, prev(f)), link)
                acc_in = link = start + ma  # sent on after folding (the last hop takes it home)
                if record:
                    ev += [(r, "comm", start[r], acc_in[r]) for r in shown]
            s = f if arrive_block is None else np.maximum(f, arrive_block)
        if acc_in is not None and steps > 1:
            s = np.maximum(s, acc_in)
        return float(s.max()), ev

    total, events = run(m_travel, m_acc, True)
    free, _ = run(0.0, 0.0 if m_acc is not None else None, False)
    compute = float(c.sum(axis=1).mean()) + (fold * steps if m_acc is not None else 0.0)
    return Pass(total, compute, max(0.0, free - compute), max(0.0, total - max(free, compute)), 0.0, events)


def _serial(parts: list[tuple[str, float]], ranks: int = 2) -> Pass:
    """Collective strategies: ``[(kind, seconds), ...]`` back to back on every rank."""
    p, t = Pass(), 0.0
    for kind, dt in parts:
        if kind != "idle":
            p.events += [(r, kind, t, t + dt) for r in range(ranks)]
        t += dt
        if kind == "compute":
            p.compute += dt
        elif kind == "idle":
            p.idle += dt
        else:
            p.exposed_comm += dt
    p.time = t
    return p


def _local_full(hw: ClusterHW, shape: AttnShape, heads: int, backward: bool, rows: int, keys: int,
                diag: bool) -> float:
    """One local call: ``rows`` queries x ``keys`` keys, ``heads`` query heads."""
    entries = rows * keys / (2 * hw.causal_eff) if diag else rows * keys
    return (entries * (10 if backward else 4) * shape.head_dim * heads * shape.batch / hw.attn_rate(backward)
            + hw.kernel_overhead_s)


def ring_sizes(shape: AttnShape, p: int, backward: str) -> tuple[int, int, int, int, int, str]:
    """``(n, e, a, kv, rows, backward)`` of a ring over ``p`` ranks: local tokens, element sizes, K/V
    elements of one shard, query rows, and the backward (``"auto"`` resolved as the library does)."""
    n = shape.seq_len // p
    e, a = element_sizes(shape)
    if backward == "auto":
        backward = plans.choose_backward(batch=shape.batch, local_seq=n, world_size=p, q_heads=shape.q_heads,
                                         kv_heads=shape.kv_heads, head_dim=shape.head_dim, dtype=shape.dtype)
    return n, e, a, 2 * shape.batch * n * shape.kv_heads * shape.head_dim, shape.batch * n * shape.q_heads, backward


def ring_strategy(hw: ClusterHW, shape: AttnShape, pl: net.Placement, layout: str, backward: str) -> AttnTimeline:
    """burst (schedule='ring') and ring: K/V ring forward; query ring or K/V ring backward."""
    p = pl.size
    n, e, a, kv, rows, backward = ring_sizes(shape, p, backward)
    merge = rows * (shape.head_dim + 1) * a * 3 / hw.mem_bw
    fw = plans.ring_work(p, layout, shape.causal, n, "kv")
    c = kernel_seconds(hw, shape, fw, False) + np.where(np.arange(p) > 0, merge, 0.0)[None, :] * (fw.calls > 0)
    fwd = _ring(c, net.shift_time(pl, kv * e), None, 0.0, True)
    fwd.bytes_sent = (p - 1) * kv * e
    if backward == "burst":
        bw = plans.ring_work(p, layout, shape.causal, n, "q")
        travel, acc = rows * (2 * shape.head_dim * e + 2 * a), rows * shape.head_dim * a
    else:
        bw = plans.ring_work(p, layout, shape.causal, n, "kv")
        travel, acc = kv * e, kv * a
    fold = acc * 3 / hw.mem_bw
    bwd = _ring(kernel_seconds(hw, shape, bw, True), net.shift_time(pl, travel), net.shift_time(pl, acc), fold, True)
    bwd.bytes_sent = (p - 1) * travel + p * acc if p > 1 else 0.0
    return AttnTimeline(fwd, bwd, backward)


def rsa_strategy(hw: ClusterHW, shape: AttnShape, pl: net.Placement) -> AttnTimeline:
    """Ring Self-Attention: a K ring builds the full ``n x N`` scores with plain matmuls (kept),
    softmax over them, a V ring; backward a K/V ring with dK/dV following. No block is skipped."""
    p, n = pl.size, shape.seq_len // pl.size
    e, a = element_sizes(shape)
    half = shape.batch * n * shape.kv_heads * shape.head_dim
    entries = shape.batch * shape.q_heads * n * n  # of one block pair
    if hw.plain_attn_rates is not None:
        fwd_rate, bwd_rate = hw.plain_attn_rates
        # the forward's two rings and the softmax split the measured per-entry cost: 1/4, 1/2, 1/4
        mm, sm, back = entries / fwd_rate / 4, entries / fwd_rate / 2, entries / bwd_rate
    else:
        mm = 2 * entries * shape.head_dim / hw.matmul_rate + 2 * entries * a / hw.mem_bw
        sm, back = 4 * entries * a / hw.mem_bw, 2 * mm + 6 * entries * a / hw.mem_bw
    work = plans.ring_work(p, "contiguous", shape.causal, n, "kv")  # a fully masked block is skipped
    live = (work.calls > 0).astype(float)
    c = live * mm
    fwd = _ring(c, net.shift_time(pl, half * e), None, 0.0, True)
    fwd.add(_serial([("compute", sm * p)]))
    fwd.add(_ring(c, net.shift_time(pl, half * e), None, 0.0, True))
    fwd.bytes_sent = 2 * (p - 1) * half * e
    cb = live * back
    bwd = _ring(cb, net.shift_time(pl, 2 * half * e), net.shift_time(pl, 2 * half * a), 6 * half * a / hw.mem_bw, True)
    bwd.bytes_sent = (p - 1) * 2 * half * e + (p if p > 1 else 0) * 2 * half * a
    return AttnTimeline(fwd, bwd, "kv")


def double_strategy(hw: ClusterHW, shape: AttnShape, pl: net.Placement, layout: str, backward: str) -> AttnTimeline:
    """burst with schedule='double': an inner ring inside nodes nested in an outer ring across them;
    the outer transfer of the next block is posted before the R inner steps and waited for after."""
    p = pl.size
    r_ = min(pl.per_node, p)
    m_ = p // r_
    n, e, a, kv, rows, backward = ring_sizes(shape, p, backward)
    inner = net.Placement(hw, r_, r_, pl.concurrent)
    outer = net.Placement(hw, m_, 1, pl.concurrent * r_)
    res = []
    for travelling, back in (("kv", False), ("kv" if backward == "kv" else "q", True)):
        work = plans.double_work(p, r_, layout, shape.causal, n, travelling)
        c = kernel_seconds(hw, shape, work, back)
        if not back:
            travel, acc = kv * e, None
        elif travelling == "q":
            travel, acc = rows * (2 * shape.head_dim * e + 2 * a), rows * shape.head_dim * a
        else:
            travel, acc = kv * e, kv * a
        total = Pass()
        for d in range(m_):
            cin = c[:, d * r_:(d + 1) * r_]
            step = _ring(cin, net.shift_time(inner, travel), None if acc is None else net.shift_time(inner, acc),
                         0.0 if acc is None else acc * 3 / hw.mem_bw, False)
            if d < m_ - 1 or (acc is not None and m_ > 1):
                hop = net.shift_time(outer, travel if d < m_ - 1 else 0.0) + (
                    net.shift_time(outer, acc) if acc is not None else 0.0)
                step.events += [(rk, "comm", 0.0, hop) for rk in range(min(8, p))]
                if hop > step.time:
                    step.exposed_comm += hop - step.time
                    step.time = hop
            total.add(step)
        total.bytes_sent = (p - 1) * travel + ((r_ * m_ if r_ > 1 else 0) + (m_ if m_ > 1 else 0)) * (acc or 0)
        res.append(total)
    return AttnTimeline(res[0], res[1], backward)


def collective_strategy(hw: ClusterHW, shape: AttnShape, pl: net.Placement, strategy: str,
                        layout: str = "contiguous") -> AttnTimeline:
    """ulysses, allgather and tp: the collectives of their byte formulas, then one local call."""
    p, n, big_n = pl.size, shape.seq_len // pl.size, shape.seq_len
    e, a = element_sizes(shape)
    f = plans.bytes_formula(strategy, batch=shape.batch, local_seq=n, world_size=p, q_heads=shape.q_heads,
                            kv_heads=shape.kv_heads, head_dim=shape.head_dim, dtype=shape.dtype)
    ops = {k: v for k, v in f["ops"].items() if k[1] != "meta"}
    idle = [0.0, 0.0]
    if strategy == "allgather":
        # every rank: its n queries against all N keys in one call, the pairs of its row of the ring plan
        # (the layout decides the balance); the collectives wait for the busiest rank
        work = plans.ring_work(p, layout, shape.causal, n, "kv")
        one = plans.StepWork(work.full.sum(1, keepdims=True), work.diag.sum(1, keepdims=True),
                             np.ones((p, 1)), work.rows.sum(1, keepdims=True))
        per_rank = [kernel_seconds(hw, shape, one, b)[:, 0] for b in (False, True)]
        comp = [float(x.mean()) for x in per_rank]
        idle = [float(x.max() - x.mean()) for x in per_rank]
        fwd = [("comm", net.all_gather_time(pl, ops[("forward", "kv")] / max(p - 1, 1))), ("compute", comp[0])]
        bwd = [("comm", net.all_gather_time(pl, ops[("backward", "kv")] / max(p - 1, 1))), ("compute", comp[1]),
               ("comm", net.reduce_scatter_time(pl, ops[("backward", "dkv")] / max(p - 1, 1)))]
    else:
        heads = shape.q_heads // p
        comp = [_local_full(hw, shape, heads, b, big_n, big_n, shape.causal) for b in (False, True)]
        if strategy == "tp":
            ag = ops[("forward", "qkv")] / max(p - 1, 1)
            fwd = [("comm", net.all_gather_time(pl, ag)), ("compute", comp[0]),
                   ("comm", net.all_to_all_time(pl, ops[("forward", "out")]))]
            bwd = [("comm", net.all_to_all_time(pl, ops[("backward", "out")])), ("compute", comp[1]),
                   ("comm", net.reduce_scatter_time(pl, ops[("backward", "qkv")] / max(p - 1, 1)))]
        else:  # ulysses: every op is an all-to-all
            fa = sum(v for (ph, _), v in ops.items() if ph == "forward")
            ba = sum(v for (ph, _), v in ops.items() if ph == "backward")
            fwd = [("comm", net.all_to_all_time(pl, fa * 0.75)), ("compute", comp[0]),
                   ("comm", net.all_to_all_time(pl, fa * 0.25))]
            bwd = [("comm", net.all_to_all_time(pl, ba * 0.25)), ("compute", comp[1]),
                   ("comm", net.all_to_all_time(pl, ba * 0.75))]
    rk = min(8, p)
    fwd.insert(2, ("idle", idle[0]))
    bwd.insert(2, ("idle", idle[1]))
    fp, bp = _serial(fwd, rk), _serial(bwd, rk)
    fp.bytes_sent = f["forward"] - plans.meta_bytes(p)
    bp.bytes_sent = f["backward"]
    return AttnTimeline(fp, bp, strategy)


def usp_strategy(hw: ClusterHW, shape: AttnShape, cp: int, stride: int, ulysses: int, backward: str) -> AttnTimeline:
    """USP: Ulysses all-to-alls over ``ulysses`` ranks (innermost), a burst ring across the rest."""
    p, n = cp, shape.seq_len // cp
    e, _ = element_sizes(shape)
    u = ulysses
    rep = plans.kv_repeats(shape.kv_heads, u)
    ul = net.placement(hw, u, stride)
    inner = AttnShape(shape.batch, shape.seq_len, shape.q_heads // u, shape.kv_heads * rep // u, shape.head_dim,
                      shape.dtype, shape.causal)
    ring = ring_strategy(hw, inner, net.placement(hw, p // u, stride * u), "zigzag", backward)
    a2a = shape.batch * n * shape.head_dim * e * (u - 1) / u
    qkv, o = a2a * (shape.q_heads + 2 * shape.kv_heads * rep), a2a * shape.q_heads
    res = []
    for ring_pass, before, after in ((ring.forward, qkv, o), (ring.backward, o, qkv)):
        pas = _serial([("comm", net.all_to_all_time(ul, before))], min(8, p))
        pas.add(ring_pass)
        pas.add(_serial([("comm", net.all_to_all_time(ul, after))], min(8, p)))
        pas.bytes_sent = ring_pass.bytes_sent + (before + after) * (1 if u > 1 else 0)
        res.append(pas)
    return AttnTimeline(res[0], res[1], ring.backward_mode)


SEQUENCE_STRATEGIES = ("burst", "ring", "rsa", "ulysses", "allgather", "usp", "tp")


def attention_timeline(strategy: str, shape: AttnShape, hw: ClusterHW, cp: int, stride: int = 1, *,
                       layout: Optional[str] = None, schedule: str = "ring", backward: str = "auto",
                       ulysses_degree: Optional[int] = None, window: Optional[int] = None) -> AttnTimeline:
    """The timeline of one attention call over a context-parallel group of ``cp`` ranks whose
    members are ``stride`` global ranks apart (``stride = tp``). Raises ``ValueError`` for an
    unknown strategy, a layout it does not take, or a shape it cannot split."""
    if strategy not in SEQUENCE_STRATEGIES:
        raise ValueError(f"strategy must be one of {SEQUENCE_STRATEGIES}, got {strategy!r}")
    layouts, default = plans.STRATEGY_LAYOUTS[strategy]
    layout = default if layout is None else layout
    if layout not in layouts:
        raise ValueError(f"strategy {strategy!r} takes layout(s) {list(layouts)}, got {layout!r}")
    if shape.seq_len % (2 * cp) and cp > 1:
        raise ValueError(f"seq_len ({shape.seq_len}) must be divisible by 2 * cp ({2 * cp})")
    pl = net.placement(hw, cp, stride)
    if strategy in ("ulysses", "tp") and shape.q_heads % cp:
        raise ValueError(f"strategy {strategy!r} splits query heads over cp={cp}: q_heads ({shape.q_heads}) must "
                         "be divisible by it")
    if window is not None:
        if strategy != "burst" or not shape.causal or schedule != "ring":
            raise ValueError("--window is simulated for strategy burst, causal, schedule ring")
        return window_strategy(hw, shape, pl, window, layout)
    if strategy == "ring":
        return ring_strategy(hw, shape, pl, "contiguous", "kv")
    if strategy == "rsa":
        return rsa_strategy(hw, shape, pl)
    if strategy in ("ulysses", "allgather", "tp"):
        return collective_strategy(hw, shape, pl, strategy, layout)
    if strategy == "usp":
        u = ulysses_degree or math.gcd(cp, shape.q_heads, hw.devices_per_node)
        if cp % u or shape.q_heads % u:
            raise ValueError(f"--ulysses-degree ({u}) must divide cp ({cp}) and the query heads per tp rank "
                             f"({shape.q_heads}) (usp)")
        return usp_strategy(hw, shape, cp, stride, u, backward)
    if schedule == "distflash":
        if not shape.causal:
            raise ValueError("schedule='distflash' is causal-only")
        return distflash_strategy(hw, shape, pl)
    if schedule == "double":
        return double_strategy(hw, shape, pl, layout, backward)
    if schedule != "ring":
        raise ValueError(f"schedule must be ring, distflash or double, got {schedule!r}")
    return ring_strategy(hw, shape, pl, layout, backward)

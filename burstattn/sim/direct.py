"""Direct (non-ring) plans replayed step by step: DistFlashAttn's load-balanced causal schedule
(:func:`burstattn.engine.direct.distflash_steps`) and the masked schedules of a sliding window
(:func:`burstattn.engine.direct.sparse_steps`), as the one loop (:func:`burstattn.engine.loop.run_plan`) runs
them: at step t every rank posts the fetch of step t+1's data, computes, posts step t's partial results
home and waits for both; each transfer is a rendezvous with a peer, so the slowest rank sets each step's
pace.
"""
from __future__ import annotations

import numpy as np

from . import net, plans
from .attn_timeline import AttnShape, AttnTimeline, Pass, element_sizes, kernel_seconds
from .hardware import ClusterHW


def distflash_strategy(hw: ClusterHW, shape: AttnShape, pl: net.Placement) -> AttnTimeline:
    """burst with schedule='distflash' (causal, contiguous): direct transfers by shifts t, P-t."""
    p, n = pl.size, shape.seq_len // pl.size
    e, a = element_sizes(shape)
    kv = 2 * shape.batch * n * shape.kv_heads * shape.head_dim
    rows = shape.batch * n * shape.q_heads
    work, kv_moves, q_moves = plans.distflash_work(p, n)

    def step_comm(t: int, kv_b: float, q_b: float) -> float:
        return max(net.shift_time(pl, kv_b, t) if kv_moves[t] else 0.0,
                   net.shift_time(pl, q_b, p - t) if q_moves[t] else 0.0)

    out = []
    for backward, q_b, ret_q, ret_kv in ((False, rows * shape.head_dim * e, rows * (shape.head_dim * e + a), 0.0),
                                         (True, rows * (2 * shape.head_dim * e + 2 * a), rows * shape.head_dim * a,
                                          kv * a)):
        c = kernel_seconds(hw, shape, work, backward)
        cmax = c.max(axis=0)
        fetch = [step_comm(t, kv * e, q_b) for t in range(1, work.steps)] + [0.0]
        rets = [0.0] + [max(net.shift_time(pl, ret_q, t) if q_moves[t] else 0.0,
                            net.shift_time(pl, ret_kv, p - t) if (ret_kv and kv_moves[t]) else 0.0)
                        for t in range(1, work.steps)]
        # the loop at step t: post the fetch of step t+1, compute, post step t's partials home,
        # wait for both; every transfer is a rendezvous with a peer, so the slowest rank sets the pace
        step = np.maximum(cmax + np.array(rets), np.array(fetch))
        pas = Pass(float(step.sum()), float(c.sum(axis=1).mean()))
        free = float(cmax.sum())
        pas.idle = max(0.0, free - pas.compute)
        pas.exposed_comm = max(0.0, pas.time - max(free, pas.compute))
        t0 = 0.0
        for t in range(work.steps):
            for rk in range(min(8, len(c))):
                pas.events += [(rk, "compute", t0, t0 + c[rk, t]), (rk, "comm", t0, t0 + max(fetch[t], 0.0))]
                if rets[t]:
                    pas.events.append((rk, "comm", t0 + c[rk, t], t0 + c[rk, t] + rets[t]))
            t0 += step[t]
        out.append(pas)
    fb = plans.distflash_bytes(rank=p - 1, batch=shape.batch, local_seq=n, world_size=p, q_heads=shape.q_heads,
                               kv_heads=shape.kv_heads, head_dim=shape.head_dim, dtype=shape.dtype)
    out[0].bytes_sent, out[1].bytes_sent = fb["forward"] - plans.meta_bytes(p), fb["backward"]
    return AttnTimeline(out[0], out[1], "distflash")



def window_strategy(hw: ClusterHW, shape: AttnShape, pl: net.Placement, window: int, layout: str,
                    block_size: int = 2048) -> AttnTimeline:
    """burst with a causal sliding window: the masked direct schedule (K/V straight to the ranks
    that need them, steps nobody needs dropped); forward and the K/V backward (dK/dV partials home)
    replayed like distflash. Partial (masked) tiles cost as much as full ones."""
    p, n = pl.size, shape.seq_len // pl.size
    if p > 64:
        raise ValueError(f"--window is simulated up to 64 context-parallel ranks, got cp={p}")
    e, a = element_sizes(shape)
    kv = 2 * shape.batch * n * shape.kv_heads * shape.head_dim
    work, kv_moves, mplans = plans.mask_work(window, block_size, shape.seq_len, p, layout)
    out = []
    for backward in (False, True):
        c = kernel_seconds(hw, shape, work, backward)
        cmax = c.max(axis=0)
        keep = [t for t in range(p) if t == 0 or kv_moves[t] or cmax[t] > 0]
        fetch = [net.shift_time(pl, kv * e, t) if kv_moves[t] else 0.0 for t in keep[1:]] + [0.0]
        rets = [0.0] + [net.shift_time(pl, kv * a, p - t) if (backward and kv_moves[t]) else 0.0 for t in keep[1:]]
        step = np.maximum(cmax[keep] + np.array(rets), np.array(fetch))
        pas = Pass(float(step.sum()), float(c.sum(axis=1).mean()))
        free = float(cmax[keep].sum())
        pas.idle = max(0.0, free - pas.compute)
        pas.exposed_comm = max(0.0, pas.time - max(free, pas.compute))
        t0 = 0.0
        for i, t in enumerate(keep):
            for rk in range(min(8, p)):
                pas.events += [(rk, "compute", t0, t0 + c[rk, t]), (rk, "comm", t0, t0 + fetch[i])]
            t0 += step[i]
        out.append(pas)
    # bytes: which peers each rank serves (the plan), at the real shard size
    b = [plans.mask_bytes(mp, batch=shape.batch, local_seq=n, q_heads=shape.q_heads, kv_heads=shape.kv_heads,
                          head_dim=shape.head_dim, dtype=shape.dtype, backward="kv") for mp in mplans]
    busiest = max(range(p), key=lambda r: b[r]["forward"] + b[r]["backward"])
    out[0].bytes_sent = b[busiest]["forward"] - plans.meta_bytes(p)
    out[1].bytes_sent = b[busiest]["backward"]
    return AttnTimeline(out[0], out[1], "kv")

"""``burstattn bench maxlen``: the longest sequence each contender fits under a per-rank memory budget.

For each contender (burstattn's strategies and peers, as in :mod:`.grid`), at one world size: the
measured peak (:mod:`.memory`, allocator events) of one forward+backward per rank, inputs and
gradients included (they are allocated inside the measured call), max over ranks. Search: double
from ``start`` while the peak stays under the budget (up to ``cap``), then bisect between the last
fit and the first miss to a multiple of ``granule`` tokens, at most ``bisect_steps`` probes. A probe
that raises (out of memory, unsupported length) counts as a miss.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from bench.grid import GridPoint, contender
from burstattn.config import torch_dtype
from burstattn.meter.progress import ProgressFile, run_with_progress


@dataclass(frozen=True)
class MaxlenConfig:
    """Flags of ``burstattn bench maxlen``."""

    mem_budget_mib: float = 1024.0
    contenders: tuple[str, ...] = ("burst", "ring", "rsa", "ulysses", "allgather", "tp")
    world_size: int = 2
    causal: bool = True
    dtype: str = "float32"
    heads: int = 8
    kv_heads: int = 8
    head_dim: int = 64
    start: int = 2048
    cap: int = 131072
    granule: int = 512
    bisect_steps: int = 3
    out: str = "bench-out"


def _probe(rank: int, world: int, p: GridPoint, progress_path: Optional[str]) -> Optional[int]:
    """Peak bytes of one fwd+bwd with inputs allocated inside the measured call, or None if it raised."""
    from burstattn.meter.memory import measure_peak

    ProgressFile(progress_path, rank).start(f"{p.contender} N={p.seq_len}")
    n, dt = p.seq_len // world, torch_dtype(p.dtype)
    try:
        c = contender(p, world)

        def step():
            q = torch.randn(p.batch, n, p.heads, p.head_dim, dtype=dt, requires_grad=True)
            k, v = (torch.randn(p.batch, n, p.kv_heads, p.head_dim, dtype=dt, requires_grad=True) for _ in "kv")
            c.fn(q, k, v).backward(torch.randn(p.batch, n, p.heads, p.head_dim, dtype=dt))
            return q.grad, k.grad, v.grad  # kept: part of what a training step holds

        dist.barrier()
        return measure_peak(step)[1].peak_bytes
    except Exception:  # noqa: BLE001 - a miss (the partner rank's collective then times out or fails too)
        return None


def search_longest(fits, *, start: int, cap: int, granule: int, bisect_steps: int) -> tuple[Optional[int], Optional[str]]:
    """The longest length ``fits(n)`` accepts: double from ``start`` up to ``cap``, then bisect between
    the last fit and the first miss to a multiple of ``granule``, at most ``bisect_steps`` probes.
    Returns ``(longest or None, note or None)``."""
    lo, hi, seq = None, None, start
    while seq <= cap:
        if not fits(seq):
            hi = seq
            break
        lo, seq = seq, seq * 2
    if lo is None:
        return None, f"even N={start} does not fit"
    if hi is None:
        return lo, f"reached the cap N={cap}"
    for _ in range(bisect_steps):
        mid = (lo + hi) // 2 // granule * granule
        if mid in (lo, hi):
            break
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, None


def _search(pool, cfg: MaxlenConfig, name: str, path: str) -> dict:
    from burstattn.testing.launch import LocalGroupError

    budget = cfg.mem_budget_mib * 2**20
    probes: list[tuple[int, Optional[int]]] = []

    def fits(seq: int) -> bool:
        p = GridPoint(name, seq, cfg.causal, cfg.dtype, cfg.heads, cfg.kv_heads, cfg.head_dim, 1, 1, 0, 0, 2)
        try:
            peaks = pool.run(_probe, p, path)
            peak = None if any(x is None for x in peaks) else max(peaks)
        except LocalGroupError:
            peak = None
        probes.append((seq, peak))
        return peak is not None and peak <= budget

    lo, note = search_longest(fits, start=cfg.start, cap=cfg.cap, granule=cfg.granule, bisect_steps=cfg.bisect_steps)
    peak_lo = next((b for n, b in probes if n == lo), None)
    return {"contender": name, "longest": lo, "peak_at_longest": peak_lo, "probes": probes, "note": note}


def run_maxlen(cfg: MaxlenConfig, console=None) -> int:
    """Search every contender; write ``<out>/maxlen.json`` and ``.md``; return 0."""
    from rich.console import Console

    from bench.driver import Pools, Started, document, publish
    from bench.report import maxlen_markdown

    console = console or Console()
    started = Started.now()
    stages = len(cfg.contenders) * (7 + cfg.bisect_steps)  # an upper bound: the bar may end early
    with Pools(timeout_s=3600.0, pg_timeout_s=300.0) as pools:
        pool = pools.get(cfg.world_size, max(1, (os.cpu_count() or 1) // cfg.world_size))
        records = run_with_progress("bench maxlen", stages,
                                    lambda path: [_search(pool, cfg, name, path) for name in cfg.contenders],
                                    console=console)
    doc = document("maxlen", cfg, started, records=records)
    publish(cfg.out, "maxlen", doc, maxlen_markdown(doc), console=console)
    return 0

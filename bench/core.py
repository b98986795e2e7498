"""``burstattn bench core``: the core benchmark of issue 2, one JSON record per point + Markdown.

Suites (all in one run, medians of repeats after warm-up):

* ``overhead``: ``burst_attn_func`` in a 1-rank group against the local kernel called directly
  (``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward on contiguous
  ``[B, H, S, D]``), same shape, same process, calls alternated. Target: within 5%.
* ``speedup``: 2 ranks x 1 thread against 1 process x 1 thread on the full sequence (the library
  at world size 1, and the raw kernel): non-causal (target >= 1.8x fwd+bwd), causal zigzag
  (target >= 1.7x), causal contiguous and striped for comparison.
* ``ceiling``: what this machine allows: 2 ranks each run the raw kernel on their half of the
  non-causal work (local queries x all keys) at the same time, with no communication at all.
* ``bytes``: bytes sent per rank (``comm_stats``) against ``engine.bytes.ring_bytes`` for world sizes
  2, 3, 4, both backward rings, MHA / GQA / bfloat16, plus what ``backward="auto"`` picked.
* ``memory``: measured peak memory per rank (:mod:`.memory`) at three sequence lengths, world 2.
* ``partials``: the cost of float32 gradient partials for 16-bit inputs (``grad_partials="float32"``,
  the default: every kernel backward runs on float32 copies of one tile at a time) against the
  kernel's own 16-bit partials (``grad_partials="kernel"``), bfloat16 causal zigzag at world 2, MHA and
  GQA: fwd+bwd time (calls alternated in one spawn) and peak memory per rank, side by side.

One pool per world size (:mod:`.driver`); every point of that world size runs inside it. Threads:
``torch.set_num_threads(1)`` in every rank (ranks x threads <= 2 cores for world sizes 1 and 2;
world sizes 3 and 4 only count bytes, where oversubscription does not matter).
"""
from __future__ import annotations

import os
import statistics
from dataclasses import asdict, dataclass, field, replace
from typing import Optional

import torch
import torch.distributed as dist

from burstattn.config import torch_dtype
from burstattn.meter.memory import measure_peak
from burstattn.meter.progress import ProgressFile
from burstattn.meter.timing import time_interleaved



@dataclass(frozen=True)
class CoreConfig:
    """Flags of ``burstattn bench core``."""

    out: str = "bench-out"        # directory for core.json and core.md
    docs: Optional[str] = None    # also write the Markdown into this file (e.g. bench/results/core.md)
    quick: bool = False           # small sizes, for a smoke run (not for the committed numbers)
    seq_len: int = 16384          # overhead and speedup points
    heads: int = 8
    head_dim: int = 64
    repeats: int = 3
    warmup: int = 1
    bytes_seq_len: int = 1536     # divisible by 2P for P = 2, 3, 4
    bytes_world_sizes: tuple[int, ...] = (2, 3, 4)
    memory_seq_lens: tuple[int, ...] = (4096, 8192, 16384)
    partials_seq_len: int = 16384  # the float32-partials points (bfloat16, world 2)
    suites: tuple[str, ...] = ("overhead", "speedup", "ceiling", "bytes", "memory", "partials")

    def effective(self) -> "CoreConfig":
        """The configuration actually run (``quick`` shrinks sizes and repeats)."""
        if not self.quick:
            return self
        return replace(self, seq_len=min(self.seq_len, 2048), repeats=min(self.repeats, 2),
                       memory_seq_lens=(512, 1024, 2048), bytes_seq_len=min(self.bytes_seq_len, 480),
                       partials_seq_len=min(self.partials_seq_len, 2048))


@dataclass(frozen=True)
class Point:
    """One benchmark point run inside a rank. ``suite``: overhead | speedup | ceiling | bytes | memory."""

    suite: str
    name: str
    seq_len: int
    heads: int
    kv_heads: int
    head_dim: int
    causal: bool
    layout: str = "zigzag"
    backward: str = "auto"
    dtype: str = "float32"
    batch: int = 1
    target: Optional[float] = None  # overhead: max ratio; speedup: min speedup
    grad_partials: str = "float32"


@dataclass
class RankResult:
    """What one rank measured for one point (times in seconds, bytes as ints)."""

    samples: dict[str, tuple[float, ...]] = field(default_factory=dict)
    peak: dict[str, int] = field(default_factory=dict)
    sent: dict[str, int] = field(default_factory=dict)
    extra: dict[str, object] = field(default_factory=dict)


# ------------------------------------------------------------------------------ rank side
def _inputs(p: Point, world: int, rank: int):
    """Random local q [B, n, Hq, D], k/v [B, n, Hkv, D], grad_out [B, n, Hq, D] (n = N / world)."""
    gen = torch.Generator().manual_seed(1000 * rank + 7)
    n, dt = p.seq_len // world, torch_dtype(p.dtype)
    q = torch.randn(p.batch, n, p.heads, p.head_dim, generator=gen).to(dt).requires_grad_()
    k = torch.randn(p.batch, n, p.kv_heads, p.head_dim, generator=gen).to(dt).requires_grad_()
    v = torch.randn(p.batch, n, p.kv_heads, p.head_dim, generator=gen).to(dt).requires_grad_()
    return q, k, v, torch.randn(p.batch, n, p.heads, p.head_dim, generator=gen).to(dt)


def _library_fns(p: Point, q, k, v, grad, grad_partials: Optional[str] = None):
    from burstattn import burst_attn_func

    kw = dict(causal=p.causal, layout=p.layout, backward=p.backward, grad_partials=grad_partials or p.grad_partials)

    def fwd():
        return burst_attn_func(q, k, v, **kw)

    def fwd_bwd():
        q.grad = k.grad = v.grad = None
        burst_attn_func(q, k, v, **kw).backward(grad)

    return fwd, fwd_bwd


def _kernel_fns(p: Point, q, k, v, grad, contiguous: bool = True):
    """The CPU flash op called directly on contiguous [B, H, S, D] copies (made once, untimed); with
    ``contiguous=False`` on ``[B, H, S, D]`` views of the caller's ``[B, S, H, D]`` tensors (what plain
    ``scaled_dot_product_attention`` on ``q.transpose(1, 2)`` hands it: the caller's layout)."""
    qh, kh, vh, gh = (x.detach().transpose(1, 2) for x in (q, k, v, grad))
    if contiguous:
        qh, kh, vh, gh = (x.contiguous() for x in (qh, kh, vh, gh))
    fwd_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    bwd_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

    def fwd():
        return fwd_op(qh, kh, vh, 0.0, p.causal)

    def fwd_bwd():
        out, lse = fwd_op(qh, kh, vh, 0.0, p.causal)
        return bwd_op(gh, qh, kh, vh, out, lse, 0.0, p.causal)

    return fwd, fwd_bwd


def _ceiling_fns(p: Point, world: int, rank: int):
    """Raw kernel on this rank's share of the non-causal work: n local queries x all N keys."""
    gen = torch.Generator().manual_seed(rank)
    n, dt = p.seq_len // world, torch_dtype(p.dtype)
    q = torch.randn(p.batch, p.heads, n, p.head_dim, generator=gen).to(dt)          # [B, H, n, D]
    k, v = (torch.randn(p.batch, p.kv_heads, p.seq_len, p.head_dim, generator=gen).to(dt) for _ in range(2))
    grad = torch.randn_like(q)
    return _kernel_fns(p, *(x.transpose(1, 2) for x in (q, k, v, grad)))


def _run_point(p: Point, rank: int, world: int, repeats: int, warmup: int) -> RankResult:
    import burstattn

    res = RankResult()
    barrier = dist.barrier if world > 1 else None
    if p.suite == "ceiling":
        kfwd, kfwd_bwd = _ceiling_fns(p, world, rank)
        timings = time_interleaved({"kernel fwd": kfwd, "kernel fwd+bwd": kfwd_bwd}, repeats=repeats,
                                   warmup=warmup, barrier=barrier)
        res.samples = {name: t.samples for name, t in timings.items()}
        return res
    q, k, v, grad = _inputs(p, world, rank)
    fwd, fwd_bwd = _library_fns(p, q, k, v, grad)
    if p.suite in ("overhead", "speedup"):
        fns = {"library fwd": fwd, "library fwd+bwd": fwd_bwd}
        if world == 1:
            kfwd, kfwd_bwd = _kernel_fns(p, q, k, v, grad)
            fns.update({"kernel fwd": kfwd, "kernel fwd+bwd": kfwd_bwd})
            if p.suite == "overhead":
                vfwd, vfwd_bwd = _kernel_fns(p, q, k, v, grad, contiguous=False)
                fns.update({"kernel (layout) fwd": vfwd, "kernel (layout) fwd+bwd": vfwd_bwd})
        timings = time_interleaved(fns, repeats=repeats, warmup=warmup, barrier=barrier)
        res.samples = {name: t.samples for name, t in timings.items()}
    elif p.suite == "memory":
        fwd_bwd()  # warm-up: communicators, allocator, lazy inits
        for name, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
            if barrier:
                barrier()
            res.peak[name] = measure_peak(fn)[1].peak_bytes
        res.extra["inputs_bytes"] = sum(x.numel() * x.element_size() for x in (q, k, v, grad))
    elif p.suite == "partials":  # float32 partials against the kernel's own, alternated, then their peaks
        fns = {f"{mode} fwd+bwd": _library_fns(p, q, k, v, grad, mode)[1] for mode in ("float32", "kernel")}
        timings = time_interleaved(fns, repeats=repeats, warmup=warmup, barrier=barrier)
        res.samples = {name: t.samples for name, t in timings.items()}
        for name, fn in fns.items():
            fn()  # the same history before each measurement: one call in this mode right before it
            if barrier:
                barrier()
            res.peak[name] = measure_peak(fn)[1].peak_bytes
        res.extra["inputs_bytes"] = sum(x.numel() * x.element_size() for x in (q, k, v, grad))
    elif p.suite == "bytes":
        with burstattn.comm_stats() as stats:
            fwd_bwd()
        res.sent = stats.sent_by_op("str")
        res.extra["backward_used"] = "burst" if stats.sent(phase="backward", op="q") else "kv"
    return res


def _bench_rank(rank: int, world: int, p: Point, repeats: int, warmup: int,
                progress_path: Optional[str]) -> RankResult:
    """One point on one rank (runs inside the pool; the points of a world size share its spawn)."""
    ProgressFile(progress_path, rank).start(f"world {world}: {p.suite} {p.name}")
    return _run_point(p, rank, world, repeats, warmup)


# ---------------------------------------------------------------------------- parent side
def _points(cfg: CoreConfig) -> dict[int, list[Point]]:
    """The plan: world size -> points."""
    h, d, n = cfg.heads, cfg.head_dim, cfg.seq_len
    plan: dict[int, list[Point]] = {1: [], 2: []}
    for causal in (False, True):
        plan[1].append(Point("overhead", "causal" if causal else "non-causal", n, h, h, d, causal,
                             layout="contiguous", target=1.05))
    plan[2] += [Point("speedup", "non-causal", n, h, h, d, False, "zigzag", target=1.8),
                Point("speedup", "causal zigzag", n, h, h, d, True, "zigzag", target=1.7),
                Point("speedup", "causal contiguous", n, h, h, d, True, "contiguous"),
                Point("speedup", "causal striped", n, h, h, d, True, "striped"),
                Point("ceiling", "2 independent kernels, no communication", n, h, h, d, False)]
    plan[2] += [Point("memory", f"N={s}", s, h, h, d, True, "zigzag") for s in cfg.memory_seq_lens]
    plan[2] += [Point("partials", f"Hq={h} Hkv={kvh}", cfg.partials_seq_len, h, kvh, d, True, "zigzag",
                      dtype="bfloat16") for kvh in (h, max(1, h // 4))]
    for world in cfg.bytes_world_sizes:
        for kvh, dtype in ((h, "float32"), (max(1, h // 4), "float32"), (h, "bfloat16")):
            for backward in ("burst", "kv", "auto"):
                plan.setdefault(world, []).append(Point(
                    "bytes", f"P={world} Hq={h} Hkv={kvh} {dtype} backward={backward}",
                    cfg.bytes_seq_len, h, kvh, d, True, "zigzag", backward, dtype))
    plan = {w: [p for p in pts if p.suite in cfg.suites] for w, pts in plan.items()}
    return {w: pts for w, pts in plan.items() if pts}


def _group_median(samples_by_rank: list[tuple[float, ...]]) -> float:
    """Median over repeats of the slowest rank's time in each repeat."""
    return statistics.median(max(per_rank) for per_rank in zip(*samples_by_rank))


def _record(p: Point, world: int, results: list[RankResult]) -> dict:
    """One JSON-ready record for a point from every rank's result."""
    from burstattn.engine import bytes as formulas

    rec: dict = {"suite": p.suite, "name": p.name, "world_size": world, "threads_per_rank": 1,
                 "config": asdict(p)}
    if results[0].samples:
        names = results[0].samples
        rec["median_s"] = {name: _group_median([r.samples[name] for r in results]) for name in names}
        rec["min_s"] = {name: min(max(rep) for rep in zip(*[r.samples[name] for r in results])) for name in names}
        rec["samples_s"] = {name: [list(r.samples[name]) for r in results] for name in results[0].samples}
    if p.suite == "partials":
        m = rec["median_s"]
        rec["time_ratio"] = m["float32 fwd+bwd"] / m["kernel fwd+bwd"]
    if results[0].peak:
        rec["peak_bytes"] = {name: max(r.peak[name] for r in results) for name in results[0].peak}
        rec["peak_bytes_per_rank"] = {name: [r.peak[name] for r in results] for name in results[0].peak}
        rec["local_seq"] = p.seq_len // world
        rec["inputs_bytes"] = results[0].extra["inputs_bytes"]
    if p.suite == "bytes":
        used = results[0].extra["backward_used"]
        ring = formulas.ring_bytes(batch=p.batch, local_seq=p.seq_len // world, world_size=world,
                                   q_heads=p.heads, kv_heads=p.kv_heads, head_dim=p.head_dim,
                                   dtype=torch_dtype(p.dtype), backward=used)
        expected = {f"{ph}/{op}": b for (ph, op), b in ring["ops"].items()}
        rec.update(backward_used=used, expected=expected,
                   sent_max={key: max(r.sent.get(key, 0) for r in results) for key in expected | results[0].sent},
                   sent_min={key: min(r.sent.get(key, 0) for r in results) for key in expected | results[0].sent})
        rec["match"] = all(rec["sent_max"].get(k, 0) == rec["sent_min"].get(k, 0) == expected.get(k, 0)
                           for k in rec["sent_max"])
    return rec


def _derive(records: list[dict]) -> None:
    """Add ratios and target verdicts (overhead vs kernel, speedup vs world size 1)."""
    base = {r["name"]: r["median_s"] for r in records if r["suite"] == "overhead"}
    for r in records:
        m = r.get("median_s")
        if r["suite"] == "overhead":
            r["overhead"] = {ps: m[f"library {ps}"] / m[f"kernel {ps}"] - 1 for ps in ("fwd", "fwd+bwd")}
            r["overhead_of_min"] = {ps: r["min_s"][f"library {ps}"] / r["min_s"][f"kernel {ps}"] - 1
                                    for ps in ("fwd", "fwd+bwd")}
            r["met"] = r["overhead"]["fwd+bwd"] <= r["config"]["target"] - 1
            if "kernel (layout) fwd" in m:  # the call path's own cost: against the kernel on the caller's layout
                r["overhead_vs_layout"] = {ps: m[f"library {ps}"] / m[f"kernel (layout) {ps}"] - 1
                                           for ps in ("fwd", "fwd+bwd")}
        elif r["suite"] == "speedup" and base:
            one = base["causal" if r["config"]["causal"] else "non-causal"]
            passes = ("fwd", "fwd+bwd")
            r["speedup_vs_library_1"] = {ps: one[f"library {ps}"] / m[f"library {ps}"] for ps in passes}
            r["speedup_vs_kernel_1"] = {ps: one[f"kernel {ps}"] / m[f"library {ps}"] for ps in passes}
            if r["config"]["target"] is not None:
                r["met"] = r["speedup_vs_library_1"]["fwd+bwd"] >= r["config"]["target"]
        elif r["suite"] == "ceiling" and base:
            one = base["non-causal"]
            r["speedup_vs_kernel_1"] = {ps: one[f"kernel {ps}"] / m[f"kernel {ps}"] for ps in ("fwd", "fwd+bwd")}


def run_core(cfg: CoreConfig, console=None) -> int:
    """Run every point, write ``core.json`` and ``core.md`` under ``cfg.out``; return 0."""
    from rich.console import Console

    from bench.driver import Pools, Started, document, publish, run_points
    from bench.report import update_document, write_markdown

    console = console or Console()
    eff = cfg.effective()
    points = [(world, p) for world, ps in sorted(_points(eff).items()) for p in ps]
    started = Started.now()
    console.print(f"bench core: {len(points)} points over world sizes {sorted({w for w, _ in points})}, "
                  f"1 thread per rank, {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}")
    with Pools(timeout_s=7200.0, pg_timeout_s=1800.0) as pools:
        records = run_points("bench core", points, _bench_rank, _record, _failed, pools=pools,
                             args=(eff.repeats, eff.warmup), console=console)
    _derive([r for r in records if "failed" not in r])
    doc = document("core", eff, started, records=records,
                   threads="torch.set_num_threads(1) in every rank (LocalPool threads_per_rank=1)")
    publish(eff.out, "core", doc, write_markdown(doc), eff.docs, update_document, console)
    return 0


def _failed(p: Point, world: int, text: str) -> dict:
    """The record of a point whose ranks raised."""
    return {"suite": p.suite, "name": p.name, "world_size": world, "config": asdict(p), "failed": text}

"""``burstattn demo``: burst attention forward + backward on a long sequence, checked and measured.

Spawns ``world_size`` local ranks (gloo on CPU; NCCL when there is one GPU per rank) with
:func:`burstattn.testing.launch.run_local`. Every rank builds the same full q/k/v from one seed (so no rank
needs anyone's data for the check), keeps its shard (``shard_sequence``) and runs
``burst_attn_func`` forward and backward. Then:

* timing: median of ``repeats`` calls after ``warmup`` (forward alone, forward + backward; each
  rank times its own calls between barriers, the slowest rank is reported);
* peak memory per rank of one forward + backward, measured (:mod:`burstattn.meter.memory`);
* bytes sent per rank (``comm_stats``) next to ``engine.bytes.ring_bytes``;
* correctness: ``check_rows`` global query rows drawn at random are recomputed exactly in float64
  against ALL keys with ``exact_rows``. The loss weights only those rows (``grad_out`` is zero
  elsewhere), so the exact dq of those rows and the exact dk, dv of the whole sequence follow from
  the row reference by autograd. Each rank computes the reference of the sampled rows it holds;
  dk, dv contributions are summed over ranks (all-reduce) before each rank compares its shard.

A dense reference at these lengths would need ``N x N`` scores; the row sample does not.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from ..config import torch_dtype
from ..meter.memory import measure_peak
from ..meter.progress import ProgressFile, run_with_progress
from ..meter.timing import default_threads_per_rank, time_repeats

TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 2e-2}  # relative Frobenius error
_STAGES = 5


@dataclass(frozen=True)
class DemoConfig:
    """What ``burstattn demo`` runs (every field is a command-line flag)."""

    world_size: int = 4           # local ranks to spawn
    seq_len: int = 16384          # global sequence length N (each rank holds N / world_size)
    heads: int = 8                # query heads
    kv_heads: Optional[int] = None  # key/value heads (None: = heads); heads % kv_heads == 0
    head_dim: int = 64
    batch: int = 1
    causal: bool = True
    layout: str = "zigzag"        # contiguous | zigzag | striped
    dtype: str = "float32"        # float32 | bfloat16 | float16
    backend: str = "auto"         # auto | reference | cpu_flash | sdpa | flash_attn
    backward: str = "auto"        # auto | burst | kv
    threads_per_rank: Optional[int] = None  # None: max(1, cores // world_size)
    check_rows: int = 256         # sampled query rows across the group, checked in float64
    repeats: int = 3              # timed repeats (median reported)
    warmup: int = 0               # untimed calls before timing, after the first (checked) call
    seed: int = 0

    @property
    def q_heads(self) -> int:
        return self.heads

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads if self.kv_heads is not None else self.heads

    @property
    def threads(self) -> int:
        return self.threads_per_rank or default_threads_per_rank(self.world_size)


@dataclass
class RankReport:
    """What one rank measured; errors as sums so the parent can form group-wide norms."""

    rank: int
    device: str
    backward_used: str
    fwd_s: float
    fwd_bwd_s: float
    peak_bytes: int
    sent: dict[str, int]           # "forward", "backward", and "phase/op" keys
    expected: dict[str, int]       # the same keys from engine.bytes.ring_bytes
    rows_checked: int
    # name -> (sum of squared differences, sum of squared reference values, max |difference|)
    err: dict[str, tuple[float, float, float]] = field(default_factory=dict)


def _full_inputs(cfg: DemoConfig, dtype: torch.dtype):
    """The whole-sequence q [B, N, Hq, D], k/v [B, N, Hkv, D] (rounded to ``dtype``) and grad_out rows."""
    gen = torch.Generator().manual_seed(cfg.seed)
    b, n, d = cfg.batch, cfg.seq_len, cfg.head_dim
    q = torch.randn(b, n, cfg.q_heads, d, generator=gen).to(dtype)
    k = torch.randn(b, n, cfg.n_kv_heads, d, generator=gen).to(dtype)
    v = torch.randn(b, n, cfg.n_kv_heads, d, generator=gen).to(dtype)
    rows = torch.randperm(n, generator=gen)[:min(cfg.check_rows, n)].sort().values  # [R] global positions
    grad_rows = torch.randn(b, rows.numel(), cfg.q_heads, d, generator=gen).to(dtype)  # [B, R, Hq, D]
    return q, k, v, rows, grad_rows


def _err(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, float]:
    diff = got.double() - ref
    return (float(diff.square().sum()), float(ref.square().sum()),
            float(diff.abs().max()) if diff.numel() else 0.0)


def _bytes(stats, cfg: DemoConfig, world: int, local_seq: int, dtype: torch.dtype):
    """(backward ring used, measured bytes, formula bytes), keyed "forward", "backward", "phase/op"."""
    from ..engine.bytes import ring_bytes

    used = "burst" if stats.sent(phase="backward", op="q") > 0 else "kv"
    if world == 1:  # nothing travels; the formula is 0 for either ring
        used = cfg.backward if cfg.backward != "auto" else "none (world size 1)"
    ring = ring_bytes(batch=cfg.batch, local_seq=local_seq, world_size=world, q_heads=cfg.q_heads,
                      kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, dtype=dtype,
                      backward=used if used in ("burst", "kv") else "burst")
    sent = {"forward": stats.sent(phase="forward"), "backward": stats.sent(phase="backward")}
    expected = {"forward": ring["forward"], "backward": ring["backward"]}
    for (phase, op), nbytes in ring["ops"].items():
        expected[f"{phase}/{op}"] = nbytes
        sent[f"{phase}/{op}"] = stats.sent(phase=phase, op=op)
    return used, sent, expected


def _check(cfg: DemoConfig, world: int, full, positions, held, sample_idx, grad_rows, got) -> dict:
    """Errors of (out, dq) on the sampled rows this rank holds and of its dk, dv shard, vs float64.

    ``full`` = (q, k, v) of the whole sequence; ``got`` = (out, dq, dk, dv) of this rank, with out
    and dq already restricted to the held sampled rows [B, r, Hq, D].
    """
    import burstattn
    from burstattn.testing.oracle import exact_rows

    q_full, k_full, v_full = full
    q_rows = q_full[:, positions[held]].double().requires_grad_()          # [B, r, Hq, D]
    k64, v64 = k_full.double().requires_grad_(), v_full.double().requires_grad_()
    out_ref, _ = exact_rows(q_rows, k64, v64, positions[held], causal=cfg.causal)
    (out_ref * grad_rows[:, sample_idx].double()).sum().backward()
    dkv = torch.stack([k64.grad, v64.grad])                                # [2, B, N, Hkv, D]
    if world > 1:
        dist.all_reduce(dkv)                                               # every rank's rows contribute
    dk_ref, dv_ref = (burstattn.shard_sequence(x, layout=cfg.layout) for x in dkv)
    refs = (out_ref.detach(), q_rows.grad, dk_ref, dv_ref)
    return {name: _err(g.cpu(), r) for name, g, r in zip(("out", "dq", "dk", "dv"), got, refs)}


def _demo_rank(rank: int, world: int, cfg: DemoConfig, progress_path: Optional[str]) -> RankReport:
    """One rank of the demo (runs in a spawned process inside the default group)."""
    import burstattn

    progress = ProgressFile(progress_path, rank)
    progress.start("building inputs, first call (checked, bytes counted)")
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
        else torch.device("cpu")
    dtype = torch_dtype(cfg.dtype)
    q_full, k_full, v_full, rows, grad_rows = _full_inputs(cfg, dtype)
    positions = burstattn.sequence_positions(cfg.seq_len, layout=cfg.layout)  # [n]
    shard = lambda x: burstattn.shard_sequence(x, layout=cfg.layout).to(device).contiguous()  # noqa: E731
    q, k, v = (shard(x).requires_grad_() for x in (q_full, k_full, v_full))
    # grad_out: zero except on the sampled rows this rank holds
    held = torch.isin(positions, rows)                                     # [n] bool
    local_idx = held.nonzero().flatten()                                   # [r] local row of each
    sample_idx = torch.searchsorted(rows, positions[held])                 # [r] its index into rows
    grad_out = torch.zeros_like(q)
    grad_out[:, local_idx.to(device)] = grad_rows[:, sample_idx].to(device)
    kwargs = dict(causal=cfg.causal, layout=cfg.layout, backend=cfg.backend, backward=cfg.backward)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None

    def forward():
        return burstattn.burst_attn_func(q, k, v, **kwargs)

    def forward_backward():
        out = burstattn.burst_attn_func(q, k, v, **kwargs)
        out.backward(grad_out)
        return out

    def clear_grads():
        q.grad = k.grad = v.grad = None

    # the first call warms up (communicators, allocator) and is the one that is counted and checked
    with burstattn.comm_stats() as stats:
        out = forward_backward()
    idx = local_idx.to(device)
    got = (out.detach()[:, idx], q.grad[:, idx], k.grad, v.grad)
    backward_used, sent, expected = _bytes(stats, cfg, world, q.shape[1], dtype)
    progress.start("timing the forward")
    t_fwd = time_repeats(forward, repeats=cfg.repeats, warmup=cfg.warmup, barrier=dist.barrier, sync=sync)
    progress.start("timing forward + backward")
    t_all = time_repeats(lambda: (clear_grads(), forward_backward()), repeats=cfg.repeats, warmup=cfg.warmup,
                         barrier=dist.barrier, sync=sync)
    progress.start("measuring peak memory of forward + backward")
    clear_grads()  # outside the measured call: frees of blocks allocated before it would go unseen
    dist.barrier()
    _, mem = measure_peak(forward_backward, device=device)  # (it silences the CPU profiler's USDT lines)
    progress.start(f"float64 reference of the {rows.numel()} sampled rows")
    err = _check(cfg, world, (q_full, k_full, v_full), positions, held, sample_idx, grad_rows, got)
    return RankReport(rank, str(device), backward_used, t_fwd.median, t_all.median, mem.peak_bytes,
                      sent, expected, int(local_idx.numel()), err)


# ------------------------------------------------------------------------------- parent side
def _rel(reports: list[RankReport], name: str) -> tuple[float, float]:
    d2 = sum(r.err[name][0] for r in reports)
    r2 = sum(r.err[name][1] for r in reports)
    return math.sqrt(d2 / r2) if r2 > 0 else math.sqrt(d2), max(r.err[name][2] for r in reports)


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.1f} MiB"


def summarize(cfg: DemoConfig, reports: list[RankReport], console) -> bool:
    """Print the result tables; True when every error is within tolerance and every byte count matches."""
    from rich.table import Table

    tol = TOLERANCE[cfg.dtype]
    perf = Table(title=f"burst attention: N={cfg.seq_len}, {cfg.world_size} rank(s) x {cfg.threads} thread(s), "
                       f"heads {cfg.q_heads}/{cfg.n_kv_heads}, head_dim {cfg.head_dim}, batch {cfg.batch}, "
                       f"{cfg.dtype}, {'causal' if cfg.causal else 'non-causal'}, {cfg.layout}, "
                       f"backward={reports[0].backward_used}")
    for col in ("measure", "slowest rank", "formula", "per rank"):
        perf.add_column(col, justify="left" if col == "measure" else "right")
    perf.add_row("forward, median", f"{max(r.fwd_s for r in reports):.3f} s", "",
                 " ".join(f"{r.fwd_s:.2f}" for r in reports))
    perf.add_row("fwd+bwd, median", f"{max(r.fwd_bwd_s for r in reports):.3f} s", "",
                 " ".join(f"{r.fwd_bwd_s:.2f}" for r in reports))
    perf.add_row("peak memory, fwd+bwd", _mib(max(r.peak_bytes for r in reports)), "",
                 " ".join(f"{r.peak_bytes / 2**20:.0f}" for r in reports))
    bytes_ok = True
    order = {"forward/kv": 0, "forward/meta": 1, "forward": 2}
    keys = sorted(reports[0].expected, key=lambda k: (k.startswith("backward"), order.get(k, 0), "/" not in k, k))
    for key in keys:
        got = [r.sent.get(key, 0) for r in reports]
        want = reports[0].expected[key]
        same = all(g == want for g in got)
        bytes_ok &= same
        perf.add_row(f"bytes sent: {key}", f"{max(got):,}", f"{want:,}",
                     "all = formula" if same else "[red]" + " ".join(f"{g:,}" for g in got))
    console.print(perf)

    check = Table(title=f"check of {sum(r.rows_checked for r in reports)} sampled rows against a float64 "
                        f"reference over all {cfg.seq_len} keys (tolerance: relative error <= {tol:g})")
    for col in ("tensor", "relative error", "max abs error", "result"):
        check.add_column(col)
    ok = True
    for name, what in (("out", "output (sampled rows)"), ("dq", "dq (sampled rows)"),
                       ("dk", "dk (all rows)"), ("dv", "dv (all rows)")):
        rel, mx = _rel(reports, name)
        passed = rel <= tol and math.isfinite(rel)
        ok &= passed
        check.add_row(what, f"{rel:.2e}", f"{mx:.2e}", "[green]PASS" if passed else "[red]FAIL")
    console.print(check)
    if not bytes_ok:
        console.print("[red]bytes sent differ from engine.bytes.ring_bytes")
    ok &= bytes_ok
    console.print("[bold green]PASS" if ok else "[bold red]FAIL")
    return ok


def config_error(cfg: DemoConfig) -> Optional[str]:
    """Why ``cfg`` cannot run (checked before spawning anything), or ``None``."""
    from ..layouts.named import split_error

    if cfg.world_size < 1:
        return f"--world-size must be >= 1, got {cfg.world_size}"
    if min(cfg.heads, cfg.n_kv_heads, cfg.head_dim, cfg.batch, cfg.repeats, cfg.check_rows) < 1:
        return "--heads, --kv-heads, --head-dim, --batch, --repeats and --check-rows must be >= 1"
    if cfg.heads % cfg.n_kv_heads:
        return f"--heads ({cfg.heads}) must be a multiple of --kv-heads ({cfg.n_kv_heads})"
    from ..kernels import resolve_backend

    device = torch.device("cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= cfg.world_size
                          else "cpu")  # what the ranks will use (launch picks nccl only then)
    try:
        resolve_backend(cfg.backend, device, torch_dtype(cfg.dtype))
    except ValueError as e:
        return f"--backend {cfg.backend}: {e}"
    return split_error(cfg.seq_len, cfg.world_size, cfg.layout)


def run_demo(cfg: DemoConfig, console=None) -> int:
    """Run the demo; print the tables; return the exit code (0 PASS, 1 FAIL, 2 bad options)."""
    from rich.console import Console

    from ..testing.launch import run_local

    console = console or Console()
    err = config_error(cfg)
    if err:
        console.print(f"[red]burstattn demo: {err}")
        return 2
    console.print(f"burstattn demo: {cfg.world_size} local ranks x {cfg.threads} thread(s) on "
                  f"{os.cpu_count()} cores, sequence of {cfg.seq_len} tokens")

    def work(path: str) -> list[RankReport]:
        return run_local(_demo_rank, cfg.world_size, cfg, path, threads_per_rank=cfg.threads, timeout_s=3600.0)

    reports = run_with_progress("demo", _STAGES, work, console=console)
    return 0 if summarize(cfg, reports, console) else 1

"""``burstattn bench train --max-len --budget-mb MB``: the longest trainable context under a memory budget.

For each contender (a checkpointing mode, the blockwise options, offload, a strategy) the
longest ``--seq-len`` whose training step fits ``budget_mb`` MiB per rank: the allocator peak of
one real, steady-state step (:func:`.train_memory.probe_step`, max over ranks) must stay within
the budget. Search: double from ``start`` while the step fits (up to ``cap``), then bisect between
the last fit and the first miss to a multiple of ``granule`` tokens (at most ``bisect_steps``
probes). Each probe runs in a fresh local group, so its resident-set high-water mark is its own.

Then, at one length every contender fits, the step times side by side (the contenders' steps
alternate, :func:`.timing.time_interleaved`): the blockwise MLP and loss against the unchunked
model, the lean remat against the remat that keeps q, k, v (the one before it); and the floor:
the lean remat's saved tensors (layers x (input + attention output + LSE)) plus the attention
call's own peak, measured alone as ``bench grid`` does.

Hold the machine-wide lock around it: ``flock /tmp/burstattn-bench.lock burstattn bench train --max-len ...``.
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

# name -> (TrainConfig overrides, variant); "blockwise" = the chunks of the config
CONTENDERS = {
    "none": (dict(checkpointing="none"), "lean"),
    "full": (dict(checkpointing="full"), "lean"),
    "remat-qkv": (dict(checkpointing="remat"), "remat-qkv"),
    "remat": (dict(checkpointing="remat"), "lean"),
    "remat+blockwise": (dict(checkpointing="remat", blockwise=True), "lean"),
    "remat+blockwise+offload": (dict(checkpointing="remat", blockwise=True, offload="all"), "lean"),
    # the attention over 4 groups of heads, one after another (--head-chunks 4; small-l3: 4 query heads, 1 kv head)
    "remat+blockwise+heads4": (dict(checkpointing="remat", blockwise=True, head_chunks=4), "lean"),
    "full+blockwise": (dict(checkpointing="full", blockwise=True), "lean"),
    "ulysses:remat+blockwise": (dict(strategy="ulysses", checkpointing="remat", blockwise=True), "lean"),
    "tp-v3:remat+blockwise": (dict(strategy="tp-v3", checkpointing="remat", blockwise=True), "lean"),
}
TIMED = ("none", "none+blockwise", "remat-qkv", "remat", "remat+blockwise")
DEFAULT = ("none", "full", "remat-qkv", "remat", "remat+blockwise", "remat+blockwise+offload",
           "ulysses:remat+blockwise", "tp-v3:remat+blockwise")


@dataclass(frozen=True)
class MaxLenConfig:
    """What ``burstattn bench train --max-len`` measures."""

    budget_mb: float = 192.0
    """Per-rank budget: the allocator peak of one training step, MiB."""
    model: str = "small-l3"
    world_size: int = 2
    threads: int = 1
    contenders: tuple[str, ...] = DEFAULT
    mlp_chunk: int = 512
    """The blockwise contenders' MLP chunk (tokens)."""
    loss_chunk: int = 256
    """The blockwise contenders' loss chunk (tokens)."""
    start: int = 2048
    cap: int = 1 << 18
    granule: int = 1024
    bisect_steps: int = 4
    time_len: int = 0
    """Length of the side-by-side timing (0: the longest that every contender fits, at most 8,192)."""
    repeats: int = 3
    out: str = "bench-out"
    plots: Optional[str] = None


def train_config(cfg: MaxLenConfig, name: str, seq_len: int):
    """``(TrainConfig, variant)`` of contender ``name`` at ``seq_len`` (``ValueError`` for an unknown name)."""
    from burstattn.train import TrainConfig

    spec = {**CONTENDERS, "none+blockwise": (dict(checkpointing="none", blockwise=True), "lean")}.get(name)
    if spec is None:
        raise ValueError(f"unknown contender {name!r}; known: {sorted(CONTENDERS)}")
    over, variant = dict(spec[0]), spec[1]
    blockwise = over.pop("blockwise", False)
    chunks = dict(mlp_chunk=cfg.mlp_chunk, loss_chunk=cfg.loss_chunk) if blockwise else dict(mlp_chunk=0, loss_chunk=0)
    return TrainConfig(model=cfg.model, seq_len=seq_len, batch=1, steps=1000, lr=1e-4, warmup=0, **chunks,
                       **over), variant


def search(cfg: MaxLenConfig, name: str, log=print) -> dict:
    """The longest fitting length of contender ``name`` and every probe ``(N, peak per rank, ...)``."""
    from bench.maxlen import search_longest
    from bench.train_memory import fresh_probe

    budget = cfg.budget_mb * 2**20
    probes: list[dict] = []

    refused: list[str] = []

    def fits(n: int) -> bool:
        if refused:  # the library rejects this configuration: no length fits
            return False
        tcfg, variant = train_config(cfg, name, n)
        t0 = time.perf_counter()
        ranks, why = fresh_probe(cfg.world_size, tcfg, variant, threads=cfg.threads)
        rec = dict(seq_len=n, wall_s=time.perf_counter() - t0)
        if ranks is None:
            rec["error"] = why
            if why.startswith("refused:"):
                refused.append(why)
        else:
            rec.update(peak_bytes=[r["peak_bytes"] for r in ranks], maxrss_bytes=[r["maxrss_bytes"] for r in ranks],
                       seconds=ranks[0]["seconds"], param_bytes=max(r["param_bytes"] for r in ranks),
                       local_tokens=ranks[0]["local_tokens"], host_bytes=[r["host_bytes"] for r in ranks],
                       chunks=ranks[0]["chunks"])
        rec["fits"] = "peak_bytes" in rec and max(rec["peak_bytes"]) <= budget
        probes.append(rec)
        log(f"  {name} N={n}: " + (f"{max(rec['peak_bytes']) / 2**20:.1f} MiB" if "peak_bytes" in rec else
                                   rec["error"]) + (" fits" if rec["fits"] else " over"))
        return rec["fits"]

    lo, note = search_longest(fits, start=cfg.start, cap=cfg.cap, granule=cfg.granule, bisect_steps=cfg.bisect_steps)
    note = refused[0] if refused else note
    return dict(contender=name, longest=lo, note=note, probes=probes)


def per_token(rec: dict) -> dict:
    """Bytes per local token at the contender's longest fit: ``peak - gradients`` over the tokens, and
    the slope between its two longest fitting probes."""
    ok = sorted((p for p in rec["probes"] if p["fits"]), key=lambda p: p["seq_len"])
    if not ok:
        return {}
    top = ok[-1]
    out = dict(at_longest=(max(top["peak_bytes"]) - top["param_bytes"]) / top["local_tokens"])
    if len(ok) >= 2:
        a = ok[-2]
        out["slope"] = (max(top["peak_bytes"]) - max(a["peak_bytes"])) / (top["local_tokens"] - a["local_tokens"])
    return out


def timed_contenders(cfg: MaxLenConfig) -> list[str]:
    """The contenders the side-by-side timing runs: those asked for (``cfg.contenders``) that
    :data:`TIMED` allows, in its order (``none+blockwise``, not a contender of the search, only with
    ``none`` and a blockwise contender asked)."""
    asked = set(cfg.contenders)
    with_twin = "none" in asked and any("blockwise" in n for n in asked)
    return [n for n in TIMED if n in asked or (n == "none+blockwise" and with_twin)]


def timing(cfg: MaxLenConfig, seq_len: int) -> dict:
    """Median step seconds of :func:`timed_contenders` at ``seq_len``, side by side in one local group
    (``{}`` when none is asked for)."""
    from burstattn.testing.launch import run_local

    pts = [(name,) + train_config(cfg, name, seq_len) for name in timed_contenders(cfg)]
    if not pts:
        return {}
    samples = run_local(_time_rank, cfg.world_size, pts, cfg.repeats, threads_per_rank=cfg.threads,
                        timeout_s=4 * 3600.0)[0]
    return {name: dict(samples=s, median_s=statistics.median(s)) for name, s in samples.items()}


def _time_rank(rank: int, world: int, pts: list, repeats: int) -> dict:
    import torch.distributed as dist

    from burstattn.train import train_step
    from burstattn.meter.timing import time_interleaved
    from bench.train_memory import build, warm_optimizer

    fns = {}
    for name, tcfg, variant in pts:
        job = build(tcfg, variant)
        warm_optimizer(job)
        fns[name] = lambda job=job: train_step(job, 1)
    return {k: list(v.samples) for k, v in time_interleaved(fns, repeats=repeats, warmup=1, barrier=dist.barrier).items()}


def floor(cfg: MaxLenConfig, seq_len: int) -> dict:
    """The floor at ``seq_len`` (lean remat, burst): saved tensors + the attention call's peak, per token."""
    from burstattn.testing.launch import run_local
    from bench.train_memory import attention_call_peak, floor_bytes

    tcfg, _ = train_config(cfg, "remat+blockwise", seq_len)
    call = max(run_local(attention_call_peak, cfg.world_size, tcfg, threads_per_rank=cfg.threads),
               key=lambda r: r["peak_bytes"])
    saved = floor_bytes(cfg.model, call["local_tokens"]) / call["local_tokens"]
    per_call = call["peak_bytes"] / call["local_tokens"]
    # each contender against the floor of its own checkpointing (full saves less than remat): burst's call
    own = {name: floor_bytes(cfg.model, 1, checkpointing=train_config(cfg, name, seq_len)[0].checkpointing) + per_call
           for name in cfg.contenders if train_config(cfg, name, seq_len)[0].checkpointing in ("remat", "full")}
    return dict(seq_len=seq_len, saved_per_token=saved, attention_call_per_token=per_call,
                per_token=saved + per_call, per_contender=own)


def run_maxlen(cfg: MaxLenConfig) -> dict:
    """Search every contender, time the side-by-side point, measure the floor; write
    ``out/train-maxlen.json`` and ``.md`` (and ``plots/train-maxlen.png``)."""
    from burstattn.meter.timing import code_version, cpu_snapshot, machine_info, other_load
    from bench.train_report import maxlen_markdown, plot_maxlen

    before, t0 = cpu_snapshot(), time.perf_counter()
    records = []
    for name in cfg.contenders:
        print(f"searching {name} (budget {cfg.budget_mb:g} MiB per rank)", flush=True)
        rec = search(cfg, name)
        rec["bytes_per_token"] = per_token(rec)
        records.append(rec)
    fitted = [r["longest"] for r in records if r["longest"]]
    unit = 2 * cfg.world_size * 256
    time_len = cfg.time_len or (min([8192] + fitted) // unit * unit if fitted else 0)
    best = max((r for r in records if r["contender"] == "remat+blockwise" and r["longest"]), default=None,
               key=lambda r: r["longest"])
    doc = dict(config=asdict(cfg), machine=machine_info(), code=code_version(), records=records,
               timing=dict(seq_len=time_len, contenders=timing(cfg, time_len)) if time_len and timed_contenders(cfg)
               else None,
               floor=floor(cfg, best["longest"]) if best else None)
    doc["wall_s"], doc["other_load"] = time.perf_counter() - t0, other_load(before, cpu_snapshot())
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train-maxlen.json").write_text(json.dumps(doc, indent=1))
    md = maxlen_markdown(doc)
    (out / "train-maxlen.md").write_text(md)
    print(md)
    if cfg.plots:
        print(f"wrote {plot_maxlen(doc, cfg.plots)}")
    return doc


def time_rows(doc: dict, hw) -> list[dict]:
    """The side-by-side step times of a ``train-maxlen.json`` against the simulator on ``hw`` (this
    machine's calibrated spec): per timed contender the measured and predicted seconds, and each
    blockwise contender's cost over its unchunked twin, measured and predicted."""
    from burstattn.sim.step import simulate
    from burstattn.sim.from_train import sim_config

    t = doc.get("timing")
    if not t:
        return []
    cfg = MaxLenConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in doc["config"].items()})
    rows = {}
    for name, rec in t["contenders"].items():
        tcfg, _ = train_config(cfg, name, t["seq_len"])
        rows[name] = dict(contender=name, measured_s=rec["median_s"],
                          predicted_s=simulate(sim_config(tcfg, cfg.world_size, hw)).time_s)
    for name, row in rows.items():
        base = name.replace("+blockwise", "")
        if base != name and base in rows:
            row["cost_measured"] = row["measured_s"] / rows[base]["measured_s"]
            row["cost_predicted"] = row["predicted_s"] / rows[base]["predicted_s"]
    return list(rows.values())

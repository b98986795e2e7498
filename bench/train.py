"""``burstattn bench train``: tokens/s and peak memory per rank of training steps.

Contenders: the context-parallel strategies (``burst``, ``ring``, ``ulysses``, ``allgather``,
``rsa``) against Megatron ``tp-v1`` and ``tp-v3``, each with and without FSDP (ZeRO-3), at several
sequence lengths with ``checkpointing="none"``; then the three checkpointing modes for ``burst``
and ``tp-v3`` at the longest length. Every point runs in one local group (``world_size`` ranks x
``threads`` threads): one warm-up step, ``repeats`` timed steps (median; steps end in a global
all-reduce, so rank 0's clock is the step's) with the contenders of one length alternating step by
step, and one step under the allocator-event meter for the peak memory per rank
(:func:`burstattn.meter.memory.measure_peak`).

Hold the machine-wide lock around it: ``flock /tmp/burstattn-bench.lock burstattn bench train``.
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass, fields, replace
from typing import Optional

CP_STRATEGIES = ("burst", "ring", "ulysses", "allgather", "rsa")
TP_STRATEGIES = ("tp-v1", "tp-v3")
MODES = ("none", "full", "remat")


@dataclass(frozen=True)
class TrainBenchConfig:
    """What ``burstattn bench train`` measures."""

    model: str = "small"
    """Model preset."""
    seq_lens: tuple[int, ...] = (1024, 2048, 4096)
    """Global sequence lengths of the strategy sweep."""
    strategies: tuple[str, ...] = CP_STRATEGIES + TP_STRATEGIES
    """Contenders of the sweep."""
    fsdp: tuple[bool, ...] = (False, True)
    """Without and with FSDP (ZeRO-3)."""
    mode_seq_len: int = 0
    """Length of the checkpointing-mode comparison (0: the longest of ``seq_lens``)."""
    mode_strategies: tuple[str, ...] = ("burst", "tp-v3")
    """Contenders of the checkpointing-mode comparison."""
    batch: int = 1
    world_size: int = 2
    threads: int = 1
    repeats: int = 3
    warmup: int = 1
    out: str = "bench-out"
    """Directory of ``train.json`` and ``train.md``."""
    plots: Optional[str] = None
    """Directory of the PNG plots (``None``: no plots)."""
    curve: Optional[str] = None
    """A ``burstattn train --metrics`` file to plot as the loss / accuracy curve."""


def points(cfg: TrainBenchConfig) -> list[dict]:
    """The TrainConfig overrides of every point, sweep first, then the checkpointing modes."""
    out = [dict(strategy=s, seq_len=n, fsdp=f, checkpointing="none", suite="sweep")
           for n in cfg.seq_lens for s in cfg.strategies for f in cfg.fsdp]
    n = cfg.mode_seq_len or max(cfg.seq_lens)
    out += [dict(strategy=s, seq_len=n, fsdp=False, checkpointing=m, suite="modes")
            for s in cfg.mode_strategies for m in MODES]
    return out


def bench_rank(rank: int, world: int, cfg: TrainBenchConfig, pts: list[dict]) -> list[dict]:
    """Rank side: every point's step times (rank 0's clock), peak bytes (this rank) or error.

    Points of one (suite, length) group are timed side by side: all their jobs are built, then
    their steps alternate (A B C A B C ...), so every contender meets the same machine load."""
    import gc

    import torch.distributed as dist

    from burstattn.train import TrainConfig, build_job, train_step
    from burstattn.meter.memory import measure_peak
    from burstattn.meter.timing import time_interleaved

    records: dict[int, dict] = {}
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(pts):
        groups.setdefault((p["suite"], p["seq_len"]), []).append(i)
    for members in groups.values():
        jobs, steps = {}, {}
        for i in members:
            over = {k: v for k, v in pts[i].items() if k != "suite"}
            try:
                jobs[i] = build_job(TrainConfig(model=cfg.model, batch=cfg.batch, steps=1000, lr=1e-4, warmup=0,
                                                **over))
            except ValueError as exc:  # raised on every rank alike (it reads only the config)
                records[i] = dict(point=pts[i], error=str(exc))
        for i, job in jobs.items():
            steps[i] = 0

            def one(i=i, job=job):
                steps[i] += 1
                return train_step(job, steps[i])
            jobs[i] = (job, one)
        timings = time_interleaved({str(i): one for i, (_, one) in jobs.items()}, repeats=cfg.repeats,
                                   warmup=cfg.warmup, barrier=dist.barrier)
        for i, (job, one) in jobs.items():
            result, peak = measure_peak(one)
            records[i] = dict(point=pts[i], times_s=list(timings[str(i)].samples), loss=result.loss,
                              peak_bytes=peak.peak_bytes, dims=asdict(job.dims))
        del jobs
        gc.collect()
    return [records[i] for i in range(len(pts))]


def combine(cfg: TrainBenchConfig, per_rank: list[list[dict]]) -> list[dict]:
    """One record per point: median step time, tokens/s and every rank's peak bytes."""
    out = []
    for i, rec in enumerate(per_rank[0]):
        row = dict(rec["point"], model=cfg.model, batch=cfg.batch, world_size=cfg.world_size, threads=cfg.threads)
        if "error" in rec:
            out.append(dict(row, error=rec["error"]))
            continue
        median = statistics.median(rec["times_s"])
        out.append(dict(row, median_s=median, times_s=rec["times_s"], tokens_per_s=cfg.batch * row["seq_len"] / median,
                        peak_bytes_per_rank=[r[i]["peak_bytes"] for r in per_rank], loss=rec["loss"], dims=rec["dims"]))
    return out


def run_train_bench(cfg: TrainBenchConfig) -> dict:
    """Run every point in one local group (its contenders of one length alternate step by step, so the
    points run in one call); write ``out/train.json`` and ``out/train.md`` (and the plots)."""
    from burstattn.train.launcher import torchrun_env
    from bench.driver import Pools

    pts = points(cfg)
    started = start()
    if torchrun_env(os.environ):  # e.g. `burstattn cluster run -- -m burstattn.cli bench train ...`
        per_rank, cfg = _under_torchrun(cfg, pts)
        if per_rank is None:
            return {}
    else:
        with Pools(timeout_s=4 * 3600.0, pg_timeout_s=1800.0) as pools:
            per_rank = pools.get(cfg.world_size, cfg.threads).run(bench_rank, cfg, pts)
    doc = document(cfg, per_rank, started)
    write_report(doc, cfg)
    return doc


def start() -> tuple:
    """What :func:`document` measures the run from: the driver's start and a CPU snapshot."""
    from bench.driver import Started
    from burstattn.meter.timing import cpu_snapshot

    return Started.now(), cpu_snapshot()


def document(cfg: TrainBenchConfig, per_rank: list[list[dict]], started: tuple, name: str = "train", **extra) -> dict:
    """The benchmark document (:func:`bench.driver.document`) with ``wall_s``, ``other_load``
    (what other processes used since ``started``, :func:`start`), ``records`` (:func:`combine`) and
    ``extra``."""
    from bench.driver import document as common
    from burstattn.meter.timing import cpu_snapshot, other_load

    run, before = started
    return common(name, cfg, run, wall_s=time.perf_counter() - run.t0, other_load=other_load(before, cpu_snapshot()),
                  records=combine(cfg, per_rank), **extra)


def config_from_dict(values: dict) -> TrainBenchConfig:
    """Inverse of ``asdict(TrainBenchConfig)`` (JSON lists back to tuples)."""
    tuples = {f.name for f in fields(TrainBenchConfig) if str(f.type).startswith("tuple")}
    return TrainBenchConfig(**{k: tuple(v) if k in tuples else v for k, v in values.items()})


def write_report(doc: dict, cfg: TrainBenchConfig, name: str = "train") -> None:
    """Write ``out/NAME.json`` and ``out/NAME.md`` (:func:`bench.driver.publish`) and the plots,
    prefixed ``NAME-``, of ``doc``."""
    from bench.driver import publish
    from bench.train_report import markdown, plot_curve, plot_sweep

    md = markdown(doc)
    print(md)
    written = publish(cfg.out, name, doc, md)
    if cfg.plots:
        written += plot_sweep(doc["records"], cfg.plots, prefix=name) + (plot_curve(cfg.curve, cfg.plots)
                                                                        if cfg.curve else [])
    print("wrote " + ", ".join(map(str, written)))


def _under_torchrun(cfg: TrainBenchConfig, pts: list[dict]):
    """Run the points in the torchrun job's group; rank 0 gets every rank's records (others: None)."""
    import datetime

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    try:
        world = dist.get_world_size()
        torch.set_num_threads(cfg.threads)
        cfg = replace(cfg, world_size=world)
        mine = bench_rank(dist.get_rank(), world, cfg, pts)
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
        return (gathered if dist.get_rank() == 0 else None), cfg
    finally:
        dist.destroy_process_group()

"""The training loop behind ``burstattn train``: resume, steps, metrics (JSON lines), progress,
checkpoints, and a clear error when a peer dies.

Runs on every rank of an initialised process group; only rank 0 prints and writes metrics. What a
resume did (the checkpoint, the ones skipped and why, warnings) is said in one line each, on
stderr; a resumed run's ``--metrics`` file keeps the lines up to the resumed step and goes on
from there (no step twice).
"""
from __future__ import annotations

import json
import os
import resource
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .checkpoint import save_checkpoint
from .config import TrainConfig
from .job import Job, build_job
from .progress import Progress
from .resume import resume
from .step import StepResult, train_step


class TrainingError(RuntimeError):
    """A collective of a training step failed (a peer died or the group timed out)."""


@dataclass(frozen=True)
class Hooks:
    """Optional callbacks (benchmarks, fault tests): ``storage_writer(step) -> DCP writer or None``,
    ``before_step(job, step)``, ``memory_probe(fn) -> (result, peak_bytes)`` around one step,
    ``log(line)`` on rank 0 for each line the run says (default: ``burstattn train: LINE`` on stderr)."""

    storage_writer: Optional[Callable] = None
    before_step: Optional[Callable] = None
    memory_probe: Optional[Callable] = None
    log: Optional[Callable] = None


def rss_bytes() -> int:
    """Resident memory of this process now (Linux ``/proc/self/statm``; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def peak_bytes(job: Job) -> tuple[int, str]:
    """``(bytes, method)``: CUDA allocator high-water mark, or the process's peak resident memory."""
    if job.device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(job.device)), "cuda_max_memory_allocated"
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "ru_maxrss"


def _per_rank(job: Job, value: int) -> list[int]:
    t = torch.zeros(dist.get_world_size(), dtype=torch.int64, device=job.device)
    t[dist.get_rank()] = value
    dist.all_reduce(t)
    return t.tolist()


def record(job: Job, result: StepResult, step: int, seconds: float, peak: int, method: str) -> dict:
    """One metrics line (collective: peak and resident memory of every rank)."""
    peaks, rss, host = _per_rank(job, peak), _per_rank(job, rss_bytes()), _per_rank(job, result.host_bytes)
    acc = result.answer_correct / result.answer_total if result.answer_total else None
    return dict(step=step, loss=result.loss, tokens_per_s=result.tokens / seconds, peak_mem_bytes=max(peaks),
                lr=result.lr, accuracy=acc, answer_loss=result.answer_loss if result.answer_total else None,
                grad_norm=result.grad_norm, step_time_s=seconds,
                peak_mem_bytes_per_rank=peaks, peak_mem_method=method, rss_bytes_per_rank=rss,
                offloaded_bytes_per_rank=host,
                world_size=job.dims.world, dp=job.dims.dp, cp=job.dims.cp, tp=job.dims.tp,
                strategy=job.cfg.strategy, layout=job.layout, fsdp=job.cfg.fsdp, checkpointing=job.cfg.checkpointing,
                mlp_chunk=job.model.config.mlp_chunk, loss_chunk=job.model.config.loss_chunk, offload=job.cfg.offload,
                targets=job.cfg.targets)


def _say(line: str) -> None:
    print(f"burstattn train: {line}", file=sys.stderr, flush=True)


def trim_metrics(path: str, step: int) -> int:
    """Keep the lines of the JSON-lines file ``path`` up to ``step`` (a resumed run writes the later
    steps again; a line cut short by a kill is dropped too); rewritten through a temporary file and
    a rename. Returns the number of lines dropped."""
    if not os.path.isfile(path):
        return 0
    kept, dropped = [], 0
    with open(path) as f:
        for line in f:
            try:
                ok = int(json.loads(line)["step"]) <= step
            except (ValueError, KeyError, TypeError):
                ok = False
            if ok:
                kept.append(line if line.endswith("\n") else line + "\n")
            else:
                dropped += 1
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, path)
    return dropped


def _guarded_step(job: Job, step: int, hooks: Hooks) -> tuple[StepResult, Optional[int]]:
    try:
        if hooks.memory_probe is not None:
            return hooks.memory_probe(lambda: train_step(job, step))
        return train_step(job, step), None
    except (RuntimeError, dist.DistError) as exc:  # gloo / NCCL errors and timeouts
        raise TrainingError(f"rank {dist.get_rank()}: a collective failed at step {step + 1} (a peer died or the "
                            f"group timed out after {job.cfg.pg_timeout_s:.0f}s): {type(exc).__name__}: "
                            f"{str(exc).splitlines()[0] if str(exc) else ''}") from exc


def train(cfg: TrainConfig, *, hooks: Hooks = Hooks(), progress: bool = True) -> list[dict]:
    """Train per ``cfg`` on this rank; returns the metrics records (every rank gets the same).

    Raises:
        ValueError: bad configuration (on every rank); :class:`~burstattn.train.resume.ResumeError`:
            ``--resume`` cannot continue (on every rank, naming the directory).
        TrainingError: a peer died or a collective timed out.
    """
    job = build_job(cfg)
    lead = dist.get_rank() == 0
    say = (hooks.log or _say) if lead else (lambda line: None)
    start = 0
    if cfg.resume:
        resumed = resume(job, cfg.ckpt_dir)
        start = resumed.step
        for line in resumed.lines():
            say(line)
    if lead and cfg.metrics and start:
        dropped = trim_metrics(cfg.metrics, start)
        if dropped:
            say(f"--metrics {cfg.metrics}: dropped {dropped} line(s) past step {start} (they are trained again)")
    show = progress and lead
    records: list[dict] = []
    metrics = open(cfg.metrics, "a" if start else "w") if cfg.metrics and lead else None
    try:
        with Progress(cfg.steps, start, enabled=show) as bar:
            for step in range(start, cfg.steps):
                if hooks.before_step is not None:
                    hooks.before_step(job, step)
                t0 = time.perf_counter()
                result, probed = _guarded_step(job, step, hooks)
                seconds = time.perf_counter() - t0
                peak, method = (probed, "profiler_memory_events") if probed is not None else peak_bytes(job)
                rec = record(job, result, step + 1, seconds, peak, method)
                records.append(rec)
                if metrics is not None:
                    metrics.write(json.dumps(rec) + "\n")
                    metrics.flush()
                if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
                    bar.update(rec)
                if cfg.ckpt_dir and ((cfg.ckpt_every and (step + 1) % cfg.ckpt_every == 0) or step + 1 == cfg.steps):
                    writer = hooks.storage_writer(step + 1) if hooks.storage_writer else None
                    save_checkpoint(job, step + 1, cfg.ckpt_dir, cfg.keep, storage_writer=writer)
    finally:
        if metrics is not None:
            metrics.close()
    return records

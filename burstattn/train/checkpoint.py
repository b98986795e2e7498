"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP): model, optimizer, LR schedule,
data position and RNG states.

Rules (DCP has no atomicity beyond its metadata: every rank writes its data files under their
final names, the coordinator writes ``.metadata`` last):

* every save goes to a fresh ``DIR/step-N`` (a stale ``step-N`` left by a crashed save is removed
  first), never over a complete checkpoint;
* the checkpoint resumed is the newest ``step-N`` that has ``.metadata``; a save killed half-way
  leaves no ``.metadata`` and is skipped;
* after a complete save, only the newest ``keep`` complete checkpoints stay.

Loading goes through DCP's resharding, so a checkpoint saved at one world size or layout loads
at another (the model and optimizer state dicts are the full-name, DTensor-aware ones of
``torch.distributed.checkpoint.state_dict``).
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from .job import Job

STEP_DIR = re.compile(r"^step-(\d+)$")


def step_dirs(root: str | Path, complete_only: bool = True) -> list[tuple[int, Path]]:
    """``(step, path)`` of the ``step-N`` directories under ``root``, oldest first (only those with
    ``.metadata`` when ``complete_only``)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = STEP_DIR.match(child.name)
        if m and child.is_dir() and (not complete_only or (child / ".metadata").is_file()):
            found.append((int(m.group(1)), child))
    return sorted(found)


def latest_checkpoint(root: str | Path) -> Optional[tuple[int, Path]]:
    """The newest complete checkpoint under ``root`` (``None``: there is none)."""
    dirs = step_dirs(root)
    return dirs[-1] if dirs else None


def _state(job: Job, step: int) -> dict:
    model_sd, optim_sd = get_state_dict(job.model, job.optimizer)
    train = {"step": step, "scheduler": job.scheduler.state_dict(), "rng_cpu": torch.get_rng_state(),
             "data": {"seed": job.cfg.seed, "next_step": step, "source": type(job.data).__name__}}
    if torch.cuda.is_available() and job.device.type == "cuda":
        train["rng_cuda"] = torch.cuda.get_rng_state(job.device)
    return {"model": model_sd, "optim": optim_sd, "train": train}


def save_checkpoint(job: Job, step: int, root: str | Path, keep: int, storage_writer=None) -> Path:
    """Save after ``step`` completed steps to ``root/step-<step>`` (every rank calls it); then keep
    the newest ``keep`` complete checkpoints. ``storage_writer``: DCP's (default: the filesystem
    writer of that directory). Returns the directory."""
    target = Path(root) / f"step-{step}"
    if dist.get_rank() == 0:
        Path(root).mkdir(parents=True, exist_ok=True)
        if target.exists():  # a stale, incomplete save of this step: never write over its files
            shutil.rmtree(target)
    dist.barrier()
    dcp.save(_state(job, step), checkpoint_id=str(target), storage_writer=storage_writer)
    dist.barrier()
    if dist.get_rank() == 0:
        for _, old in step_dirs(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return target


def load_checkpoint(job: Job, path: str | Path) -> int:
    """Load ``path`` into the job (model, optimizer, LR schedule, RNG) and return its step."""
    state = _state(job, 0)
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(job.model, job.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    train = state["train"]
    job.scheduler.load_state_dict(train["scheduler"])
    torch.set_rng_state(train["rng_cpu"])
    if "rng_cuda" in train:
        torch.cuda.set_rng_state(train["rng_cuda"], job.device)
    return int(train["step"])


def resume(job: Job, root: str | Path) -> int:
    """Load the newest complete checkpoint under ``root``; return its step (0: none, start fresh).

    Every rank decides from rank 0's listing (one shared filesystem view)."""
    found = [latest_checkpoint(root)]
    dist.broadcast_object_list(found, src=0)
    if found[0] is None:
        return 0
    return load_checkpoint(job, found[0][1])

"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP): model, optimizer, LR schedule,
data position and RNG states.

Rules (DCP has no atomicity beyond its metadata: every rank writes its data files under their
final names, the coordinator writes ``.metadata`` last):

* every save goes to a fresh ``DIR/step-N`` (a stale ``step-N`` left by a crashed save is removed
  first), never over a complete checkpoint;
* the checkpoint resumed is the newest ``step-N`` that has ``.metadata``; a save killed half-way
  leaves no ``.metadata`` and is skipped;
* after a complete save, only the newest ``keep`` complete checkpoints stay;
* before loading, :func:`damage` checks a checkpoint without reading its tensors: ``.metadata``
  must unpickle and every data file it names must hold the bytes it records (a truncated or
  missing ``.distcp`` is found here, not by a traceback from inside DCP's load).

Every checkpoint also holds its run (``train.run``: the training config, the model config, the
world size and degrees, as JSON), which :mod:`.resume` compares with the run that loads it.

Loading goes through DCP's resharding, so a checkpoint saved at one world size or layout loads
at another (the model and optimizer state dicts are the full-name, DTensor-aware ones of
``torch.distributed.checkpoint.state_dict``).
"""
from __future__ import annotations

import json
import re
import shutil
import warnings
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from .checks import model_config
from .job import Job, lr_lambda

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


def damage(path: str | Path) -> Optional[str]:
    """Why the checkpoint directory ``path`` cannot load (``None``: it looks complete): no or an
    unreadable ``.metadata``, or a data file it names missing or shorter than the bytes it records.
    Reads only the metadata and the files' sizes."""
    path = Path(path)
    if not (path / ".metadata").is_file():
        return "no .metadata (a save that did not finish)"
    try:
        md = FileSystemReader(str(path)).read_metadata()
    except Exception as exc:  # noqa: BLE001 - truncated or foreign: pickle, EOF, attribute errors
        return f".metadata is unreadable ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    need: dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if name is not None:
            need[name] = max(need.get(name, 0), int(info.offset) + int(info.length))
    for name, size in sorted(need.items()):
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        have = f.stat().st_size
        if have < size:
            return f"{name} is truncated ({have:,} of {size:,} bytes)"
    return None


def model_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Global shapes of the model tensors a checkpoint holds (from its metadata), by name."""
    md = FileSystemReader(str(path)).read_metadata()
    return {k[len("model."):]: tuple(v.size) for k, v in md.state_dict_metadata.items()
            if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}


def read_run(path: str | Path) -> Optional[dict]:
    """The run a checkpoint was saved by (``train.run``; ``None`` for a checkpoint without one).
    No process group needed (call it on one rank)."""
    if "train.run" not in _keys(path):
        return None
    holder = {"train": {"run": ""}}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(holder, checkpoint_id=str(path), no_dist=True)
    return json.loads(holder["train"]["run"])


def run_info(job: Job) -> dict:
    """What :func:`read_run` gives back: the training and model configs, world size and degrees."""
    d = job.dims
    return {"config": job.cfg.to_dict(), "model": model_config(job.cfg).to_dict(), "world_size": d.world,
            "dims": {"dp": d.dp, "cp": d.cp, "tp": d.tp}, "layout": job.layout}


def _state(job: Job, step: int) -> dict:
    model_sd, optim_sd = get_state_dict(job.model, job.optimizer)
    train = {"step": step, "scheduler": job.scheduler.state_dict(), "rng_cpu": torch.get_rng_state(),
             "data": {"seed": job.cfg.seed, "next_step": step, "source": type(job.data).__name__},
             "run": json.dumps(run_info(job))}
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
    """Load ``path`` into the job (model, optimizer, RNG; the LR schedule is rebuilt at the loaded
    step from the job's config) and return its step. Raises DCP's ``CheckpointException`` on every
    rank when a file cannot be read (:func:`damage` finds truncation before that)."""
    state = _state(job, 0)
    if "train.run" not in _keys(path):  # a checkpoint from before runs were recorded
        state["train"].pop("run")
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(job.model, job.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    train = state["train"]
    step = int(train["step"])
    job.scheduler = schedule_at(job, step)  # (the saved scheduler state holds nothing this does not)
    torch.set_rng_state(train["rng_cpu"])
    if "rng_cuda" in train:
        torch.cuda.set_rng_state(train["rng_cuda"], job.device)
    return step


def schedule_at(job: Job, step: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The job's LR schedule (its config's ``lr_lambda``, base rates from the groups' ``initial_lr``)
    positioned after ``step`` steps: the rate of a group is ``initial_lr * lambda(step)``, as after
    ``step`` calls of ``scheduler.step()`` (bitwise: the same product)."""
    return torch.optim.lr_scheduler.LambdaLR(job.optimizer, lr_lambda(job.cfg), last_epoch=step - 1)


def _keys(path: str | Path) -> set[str]:
    return set(FileSystemReader(str(path)).read_metadata().state_dict_metadata)

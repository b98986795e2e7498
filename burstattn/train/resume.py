"""``--resume``: which checkpoint a run continues from, and saying so.

Rank 0 surveys ``--ckpt-dir`` (newest ``step-N`` first: :func:`~.checkpoint.damage`, the saved run,
the model's tensor shapes) and broadcasts it, so every rank takes the same decisions:

* ``--ckpt-dir`` missing: refused (a mistyped path would silently start a fresh run);
  no ``step-N`` in it yet: a fresh start, said in one line;
* damaged checkpoints (an unfinished save, a truncated ``.metadata`` or ``.distcp``, one DCP cannot
  read) are skipped, each with one line saying why, down to the newest that loads; none loads:
  refused, naming the directory;
* a checkpoint of another model (its config fields, or for checkpoints without a saved run, its
  tensor shapes): refused, naming the fields;
* another data stream or optimisation (:data:`REFUSED`: seed, lr, batch, ...): refused unless
  ``allow_changes`` (then warned, and the new values apply); another ``steps`` or ``dtype``: warned;
  another world size, strategy or degrees: said (DCP reshards).

Refusals raise :class:`ResumeError` (a ``ValueError``) on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from .checkpoint import damage, load_checkpoint, model_shapes, read_run, schedule_at, step_dirs
from .checks import model_config
from .job import Job

REFUSED = ("seed", "lr", "batch", "seq_len", "data", "data_format", "targets", "warmup", "min_lr_ratio",
           "weight_decay", "adam_eps", "grad_clip")
"""Fields whose change makes the resumed run differ from an uninterrupted one (the data stream, the
optimisation): refused without ``allow_changes``."""
WARNED = ("steps", "dtype")
"""Fields a resumed run may change with a warning (``steps`` moves the end of the LR schedule)."""


class ResumeError(ValueError):
    """``--resume`` cannot continue (raised on every rank; one line naming the directory)."""


@dataclass(frozen=True)
class Entry:
    """One ``step-N`` directory as rank 0 saw it: why it cannot load (``None``: it looks fine), the
    run it was saved by and its model tensors' shapes (when readable)."""

    step: int
    path: str
    problem: Optional[str]
    run: Optional[dict]
    shapes: dict


@dataclass(frozen=True)
class Resumed:
    """What :func:`resume` did: ``step`` (0: a fresh start), the checkpoint it loaded, the ones it
    skipped (``(path, why)``) and its notes (warnings, resharding): :meth:`lines` says it all."""

    step: int
    path: Optional[str]
    skipped: tuple[tuple[str, str], ...] = ()
    notes: tuple[str, ...] = ()

    def lines(self) -> list[str]:
        out = [f"skipped {path}: {why}" for path, why in self.skipped]
        if self.path is not None:
            out.append(f"resumed from {self.path} (step {self.step})")
        return out + list(self.notes)


def survey(root: str | Path) -> Optional[list[Entry]]:
    """The ``step-N`` directories under ``root``, newest first (``None``: ``root`` is not a directory)."""
    root = Path(root)
    if not root.is_dir():
        return None
    entries = []
    for step, child in reversed(step_dirs(root, complete_only=False)):
        problem, run, shapes = damage(child), None, {}
        if problem is None:
            try:
                run, shapes = read_run(child), model_shapes(child)
            except (Exception, CheckpointException) as exc:  # noqa: BLE001 - unreadable for any reason
                problem = f"unreadable ({type(exc).__name__}: {_first_line(exc)})"
        entries.append(Entry(step, str(child), problem, run, shapes))
    return entries


def _first_line(exc: BaseException) -> str:
    if isinstance(exc, CheckpointException) and exc.failures:
        inner = next(iter(exc.failures.values()))[0]
        return f"{type(inner).__name__}: {_first_line(inner)}"
    text = str(exc).strip()
    return text.splitlines()[-1] if text else ""


def model_mismatch(job: Job, entry: Entry) -> Optional[str]:
    """The model fields (or, without a saved run, the tensors) in which ``entry`` differs from the job."""
    if entry.run is not None:
        saved, now = entry.run["model"], model_config(job.cfg).to_dict()
        diff = [f"{k} {saved.get(k)!r} there, {now[k]!r} here" for k in now if saved.get(k) != now[k]]
        return ", ".join(diff) or None
    now = {k: tuple(v.shape) for k, v in get_model_state_dict(job.model).items()}
    diff = [f"{k} {list(entry.shapes[k]) if k in entry.shapes else 'absent'} there, "
            f"{list(now[k]) if k in now else 'absent'} here"
            for k in sorted(set(now) | set(entry.shapes)) if now.get(k) != entry.shapes.get(k)]
    return (", ".join(diff[:3]) + (f" (and {len(diff) - 3} more tensors)" if len(diff) > 3 else "")) or None


def run_changes(job: Job, entry: Entry) -> tuple[list[str], list[str]]:
    """``(refused, warned)``: descriptions ``"lr 0.001 -> 0.002"`` of the changed fields."""
    if entry.run is None:
        return [], []
    saved, now = entry.run["config"], job.cfg.to_dict()
    changed = [k for k in (*REFUSED, *WARNED) if k in saved and saved[k] != now[k]]
    text = {k: f"--{k.replace('_', '-')} {saved[k]!r} -> {now[k]!r}" for k in changed}
    return [text[k] for k in changed if k in REFUSED], [text[k] for k in changed if k in WARNED]


def layout_note(job: Job, entry: Entry) -> Optional[str]:
    """One line when the checkpoint was saved at another world size, strategy or degrees."""
    if entry.run is None:
        return None
    cfg, d = entry.run["config"], entry.run["dims"]
    then = f"world {entry.run['world_size']}, {cfg['strategy']} dp={d['dp']} cp={d['cp']} tp={d['tp']}" + (
        ", FSDP" if cfg.get("fsdp") else "")
    dims = job.dims
    now = f"world {dims.world}, {job.cfg.strategy} dp={dims.dp} cp={dims.cp} tp={dims.tp}" + (
        ", FSDP" if job.cfg.fsdp else "")
    return None if then == now else f"resharded: saved at {then}; now {now}"


def apply_changes(job: Job, step: int) -> None:
    """Put the job's own optimisation settings over the loaded optimizer's (``allow_changes``):
    learning rate (the schedule's base), weight decay and epsilon."""
    for group in job.optimizer.param_groups:
        group["initial_lr"], group["weight_decay"], group["eps"] = job.cfg.lr, job.cfg.weight_decay, job.cfg.adam_eps
    job.scheduler = schedule_at(job, step)


def resume(job: Job, root: str | Path) -> Resumed:
    """Load the newest checkpoint under ``root`` that loads into ``job`` (every rank calls it);
    see the module docstring for what is skipped, refused and said.

    Raises:
        ResumeError: on every rank, naming the directory: ``root`` missing, no checkpoint loads,
            another model, or refused changes of the run.
    """
    found = [survey(root) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(found, src=0)  # one view of the filesystem: rank 0's
    entries = found[0]
    if entries is None:
        raise ResumeError(f"--resume: --ckpt-dir {str(root)!r} does not exist (mistyped?); drop --resume to start "
                          "a fresh run there")
    if not entries:
        return Resumed(0, None, notes=(f"--resume: no checkpoint in {root} yet: starting at step 1",))
    skipped: list[tuple[str, str]] = []
    for entry in entries:
        if entry.problem is not None:
            skipped.append((entry.path, entry.problem))
            continue
        mismatch = model_mismatch(job, entry)
        if mismatch:
            raise ResumeError(f"--resume: {entry.path} holds another model ({mismatch}); resume it with the "
                              "model it was saved with, or use another --ckpt-dir")
        refused, warned = run_changes(job, entry)
        if refused and not job.cfg.allow_changes:
            raise ResumeError(f"--resume: {entry.path} was saved by a run with other settings ({', '.join(refused)}); "
                              "resume with its values, or pass --allow-changes to continue with the new ones")
        try:
            step = load_checkpoint(job, entry.path)
        except CheckpointException as exc:  # the same on every rank: DCP gathers the failures
            skipped.append((entry.path, f"loading failed ({_first_line(exc)})"))
            continue
        notes = []
        if refused:
            apply_changes(job, step)
            notes.append(f"--allow-changes: {', '.join(refused)} (the run differs from an uninterrupted one "
                         "from here on)")
        if warned:
            notes.append(f"changed: {', '.join(warned)}")
        note = layout_note(job, entry)
        if note:
            notes.append(note)
        return Resumed(step, entry.path, tuple(skipped), tuple(notes))
    raise ResumeError(f"--resume: no checkpoint in {root} loads: "
                      + "; ".join(f"{Path(p).name}: {why}" for p, why in skipped))

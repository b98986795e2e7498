"""Rank-side functions of the training tests (module-level so they pickle by reference)."""
from __future__ import annotations

import torch

from burstattn.ops import SAVED_OPS
from burstattn.train import TrainConfig, build_job, train_step


def full_params(model) -> dict[str, torch.Tensor]:
    """Every parameter as a full (unsharded) float64 CPU tensor, by name."""
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = t.detach().double().cpu()
    return out


def run_training(rank: int, world: int, cfg: TrainConfig, with_params: bool = True) -> dict:
    """``cfg.steps`` steps; the global losses of every step and (rank 0) the final parameters."""
    job = build_job(cfg)
    results = [train_step(job, s) for s in range(cfg.steps)]
    params = full_params(job.model) if with_params else None
    return dict(losses=[r.loss for r in results], norms=[r.grad_norm for r in results],
                answer_losses=[r.answer_loss for r in results], answers=[r.answer_total for r in results],
                params=params if rank == 0 else None)


# ---- checkpointing modes ------------------------------------------------------------------------
class OpCounter:
    """Counts the executions of the attention ops (``attention_fwd``, every strategy; a dispatch mode: a call that ``remat``'s
    recomputation answers from its record never reaches it)."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func in SAVED_OPS:
                    counter.calls += 1
                return func(*args, **(kwargs or {}))

        self.calls, self.mode = 0, Mode()


def checkpointing_modes(rank: int, world: int, cfg: TrainConfig) -> dict:
    """Per mode: attention op executions and forward bytes of one step (forward + backward), full
    gradients, peak bytes of one step, and the bytes the forward keeps for the backward (``kept``:
    allocated when the loss is computed, still held at the end of the forward; the same model states
    and batch in every mode)."""
    import burstattn
    from burstattn.meter.memory import measure_peak
    from burstattn.train import local_batch

    out = {}
    for mode in ("none", "full", "remat"):
        job = build_job(cfg.with_overrides(checkpointing=mode))
        tokens, labels, _, total = local_batch(job, 0)

        def step():
            job.model(tokens, job.positions, labels=labels, total_targets=total).loss.backward()

        counter = OpCounter()
        with burstattn.comm_stats() as stats, counter.mode:
            step()
        grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).double().clone()
                 for n, p in job.model.named_parameters()}
        job.model.zero_grad(set_to_none=True)
        _, peak = measure_peak(step)
        job.model.zero_grad(set_to_none=True)
        out_, kept = measure_peak(lambda: job.model(tokens, job.positions, labels=labels, total_targets=total))
        out_.loss.backward()
        out[mode] = dict(calls=counter.calls, forward_bytes=stats.sent(phase="forward"), kept=kept.end_bytes,
                         grads=grads if rank == 0 else None, peak=peak.peak_bytes, layers=len(job.model.layers))
    return out


# ---- checkpoints, resume, faults ----------------------------------------------------------------
class Interrupt(Exception):
    """Raised by a hook to stop a run between steps (as a crash would, but catchable)."""


def loop_run(rank: int, world: int, cfg: TrainConfig, stop_before: int = 0, kill: str = "",
             kill_step: int = 0) -> dict:
    """``burstattn.train.loop.train`` with optional faults: ``stop_before`` (raise Interrupt before
    that 0-based step), ``kill="save"`` (rank 1 SIGKILLs itself after writing its data of the save
    at ``kill_step``) or ``kill="step"`` (rank 1 SIGKILLs itself before step ``kill_step``)."""
    import os
    import signal

    from torch.distributed.checkpoint import FileSystemWriter

    from burstattn.train.loop import Hooks, train

    class KillingWriter(FileSystemWriter):
        def write_data(self, plan, planner):
            fut = super().write_data(plan, planner)
            fut.wait()
            os.kill(os.getpid(), signal.SIGKILL)

    def before(job, step):
        if stop_before and step == stop_before:
            raise Interrupt(step)
        if kill == "step" and step == kill_step and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)

    def writer(step):
        if kill == "save" and step == kill_step and rank == 1:
            return KillingWriter(os.path.join(cfg.ckpt_dir, f"step-{step}"))
        return None

    lines: list[str] = []  # what rank 0 says (resumed from, skipped, warnings)
    try:
        hooks = Hooks(storage_writer=writer, before_step=before, log=lines.append)
        return dict(records=train(cfg, hooks=hooks, progress=False), log=lines)
    except Interrupt:
        return dict(records=None, log=lines)


def load_and_continue(rank: int, world: int, cfg: TrainConfig, extra_steps: int) -> dict:
    """Resume ``cfg`` from its newest checkpoint, return the loaded step, the full parameters as
    loaded and the losses of ``extra_steps`` more steps."""
    from burstattn.train.resume import resume

    job = build_job(cfg)
    start = resume(job, cfg.ckpt_dir).step
    params = full_params(job.model)
    losses = [train_step(job, s).loss for s in range(start, start + extra_steps)]
    return dict(start=start, params=params if rank == 0 else None, losses=losses)


def save_at(rank: int, world: int, cfg: TrainConfig) -> dict:
    """Train ``cfg.steps`` steps, save ``step-<steps>``, return the full parameters and the losses
    of two more steps."""
    from burstattn.train.checkpoint import save_checkpoint

    job = build_job(cfg)
    for s in range(cfg.steps):
        train_step(job, s)
    save_checkpoint(job, cfg.steps, cfg.ckpt_dir, keep=cfg.keep)
    params = full_params(job.model)
    losses = [train_step(job, s).loss for s in range(cfg.steps, cfg.steps + 2)]
    return dict(params=params if rank == 0 else None, losses=losses)


def soak(rank: int, world: int, cfg: TrainConfig) -> list[dict]:
    """``cfg.steps`` steps through the loop; every step's metrics record (resident memory per rank)."""
    from burstattn.train.loop import train

    return train(cfg, progress=False)


# ---- the blockwise options ----------------------------------------------------------------------
def run_many(rank: int, world: int, cfgs: list) -> list[dict]:
    """:func:`run_training` of every config in turn (one pool call); the offload path copies on CPU
    (``Llama.offload_copies_on_cpu``) so that its bookkeeping is exercised."""
    out = []
    for cfg in cfgs:
        job = build_job(cfg)
        job.model.offload_copies_on_cpu = True
        results = [train_step(job, s) for s in range(cfg.steps)]
        params = full_params(job.model)
        out.append(dict(losses=[r.loss for r in results], answer_losses=[r.answer_loss for r in results],
                        hits=[r.answer_correct for r in results], params=params if rank == 0 else None,
                        chunks=(job.model.config.mlp_chunk, job.model.config.loss_chunk),
                        host_bytes=[r.host_bytes for r in results]))
    return out


def probe_many(rank: int, world: int, cfgs: list) -> list[dict]:
    """One steady-state step of every config (:func:`bench.train_memory.probe_step`), the
    offload copies made on CPU so that their bytes are counted. Configs whose collectives run through
    gloo's worker thread in bulk (ulysses' all-to-alls, FSDP's all-gathers, tensor parallelism's
    all-reduces: one full-suite run measured tiny's tp-v3 at 8.79 MiB against 8.31 alone) take the
    smallest peak of 2 steps: that thread frees its buffers late at times, which a single measurement cannot tell from the
    program's own peak (the band rule in tests/helpers.py)."""
    from bench.train_memory import probe_step

    return [probe_step(rank, world, c, copy_offload=True,
                       repeats=2 if c.fsdp or c.strategy == "ulysses" or c.strategy.startswith("tp") or c.tp not in (None, 1)
                       else 1)
            for c in cfgs]

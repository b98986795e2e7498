"""The library's own models over a real group: training steps, checkpointing modes, the training loop
(interrupted, resumed, soaked), dynamic dispatch, the fused loss, and generation with its cache.

Every rank builds the same model from the same seed; the parent compares with the same model on one
process.
"""
from __future__ import annotations

from dataclasses import dataclass
from unittest import mock

import torch
import torch.distributed as dist

import burstattn
from burstattn.infer.generate import continue_generation, generate
from burstattn.infer.steps import decode_step
from burstattn.models import AttnCall, Llama, preset
from burstattn.ops import SAVED_OPS
from burstattn.config import IGNORE_INDEX
from burstattn.parallel import sum_grads
from burstattn.train import TrainConfig, build_job, job as job_module, train_step
from burstattn.train.job import local_batch


# ---- training (test_train_*, test_blockwise_training, test_plan_train, test_sim_memory, test_dryrun) ----
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


# ---- checkpointing modes -------------------------------------------------------------------------
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


# ---- checkpoints, resume, faults -----------------------------------------------------------------
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


# ---- the blockwise options -----------------------------------------------------------------------
def blockwise_runs(rank: int, world: int, cfgs: list) -> list[dict]:
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


# ---- dynamic dispatch (test_dispatch.py, test_hybrid_train.py) -----------------------------------
def dispatch_runs(rank: int, world: int, cfgs: list[TrainConfig]) -> list[dict]:
    """Each config's ``steps`` steps: losses, and (rank 0) the final parameters; a ValueError is
    returned as its message (so one pool call checks refusals on every rank too)."""
    out = []
    for cfg in cfgs:
        try:
            job = build_job(cfg)
            losses = [train_step(job, s).loss for s in range(cfg.steps)]
        except ValueError as exc:
            out.append(f"ValueError: {exc}")
            continue
        out.append(dict(losses=losses, params=full_params(job.model) if rank == 0 else None,
                        world=dist.get_world_size()))
    return out


def differing_batches(rank: int, world: int) -> str:
    """Every rank must refuse a global batch that differs across ranks (here: rank 1's last length)."""
    import torch.distributed as dist

    from burstattn.train.dispatch_step import check_same_batch

    lengths = [5, 7, 9 + (rank == 1)]
    try:
        check_same_batch(lengths, dist.group.WORLD)
    except ValueError as exc:
        return str(exc)
    return "accepted"


# ---- the fused loss (test_fused_loss_training.py) ------------------------------------------------
def _accumulated_step(job, step: int, micro: int) -> float:
    """One optimizer step over the batches of ``micro`` consecutive data steps (gradient
    accumulation): each micro-batch's loss divided by the targets of all of them (the global-batch
    mean), one backward each, then the replicas' sum and AdamW. Returns the global loss."""
    batches = [local_batch(job, step * micro + i) for i in range(micro)]
    total = sum(b[3] for b in batches)
    loss = torch.zeros((), dtype=torch.float64)
    for tokens, labels, answer, _ in batches:
        out = job.model(tokens, job.positions, labels=labels, total_targets=total,
                        answer=answer & (labels != IGNORE_INDEX))
        out.loss.backward()
        loss += out.loss.detach().double()
    if not job.cfg.fsdp:
        sum_grads(job.model, job.replicas)
    job.optimizer.step()
    job.optimizer.zero_grad(set_to_none=True)
    torch.distributed.all_reduce(loss, group=job.replicas)
    return float(loss)


def fused_loss_runs(rank: int, world: int, cases: list) -> list[dict]:
    """Every ``(cfg, tie, micro)`` in turn: ``cfg.steps`` optimizer steps (``micro`` > 1: gradient
    accumulation over that many data steps each) with the preset's embeddings tied when ``tie``.
    Returns per case the global losses, the answer hits and the full parameters (rank 0)."""
    out = []
    original = job_module.model_config
    for cfg, tie, micro in cases:
        with mock.patch.object(job_module, "model_config",
                               lambda c: original(c).with_overrides(tie_embeddings=tie)):
            job = build_job(cfg)
        if micro == 1:
            results = [train_step(job, s) for s in range(cfg.steps)]
            losses, hits = [r.loss for r in results], [r.answer_correct for r in results]
        else:
            losses, hits = [_accumulated_step(job, s, micro) for s in range(cfg.steps)], []
        params = full_params(job.model)
        out.append(dict(losses=losses, hits=hits, params=params if rank == 0 else None,
                        fused=job.model.config.fused_loss))
    return out


# ---- generation (test_infer.py) ------------------------------------------------------------------
# Every rank builds the ``tiny`` model from the same seed and the same prompts; the parent compares
# with :func:`reference_tokens` (single process, the whole sequence recomputed every step, no cache).
VOCAB = 256


@dataclass(frozen=True)
class GenCase:
    """A prefill strategy at a world size, a prompt length, a continuation mode."""

    world: int
    strategy: str = "burst"
    prompt_len: int = 13
    new_tokens: int = 5
    more_len: int = 9
    more_tokens: int = 4
    continuation: str = "auto"
    batch: int = 2
    seed: int = 0

    def id(self) -> str:
        return f"w{self.world}-{self.strategy}-n{self.prompt_len}-m{self.more_len}-{self.continuation}"


def tiny_model(seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    return Llama(preset("tiny"), attn=AttnCall(strategy="burst", layout="contiguous",
                                               options=dict(backend="reference"))).eval()


def prompts(case: GenCase) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(case.seed + 100)
    return (torch.randint(0, VOCAB, (case.batch, case.prompt_len), generator=gen),
            torch.randint(0, VOCAB, (case.batch, case.more_len), generator=gen))


@torch.no_grad()
def reference_tokens(case: GenCase) -> tuple[torch.Tensor, torch.Tensor]:
    """Single-process greedy tokens: ``new_tokens`` after the prompt, then ``more_tokens`` after the
    second prompt, recomputing the whole sequence each step."""
    model = tiny_model(case.seed)
    prompt, more = prompts(case)
    seq, turns = prompt, []
    for extra, count in ((None, case.new_tokens), (more, case.more_tokens)):
        if extra is not None:
            seq = torch.cat([seq, extra], dim=1)
        out = []
        for _ in range(count):
            token = model(seq, torch.arange(seq.shape[1]))[:, -1].argmax(-1)
            out.append(token)
            seq = torch.cat([seq, token[:, None]], dim=1)
        turns.append(torch.stack(out, dim=1))
    return turns[0], turns[1]


def sent_by_op(stats) -> dict:
    return {op: row["sent"] for ops in stats.as_dict().values() for op, row in ops.items()}


def generate_and_continue(rank: int, world: int, case: GenCase) -> dict:
    """Prefill + decode, one decode step under the byte meter, then a continuation under it."""
    model = tiny_model(case.seed)
    prompt, more = prompts(case)
    first = generate(model, prompt, case.new_tokens, strategy=case.strategy, backend="reference")
    probe = generate(model, prompt, 1, strategy=case.strategy, backend="reference")  # the prefill alone
    lengths_after_prefill = probe.cache.lengths
    with burstattn.comm_stats() as stats:
        decode_step(model, probe.tokens[:, -1], probe.cache, backend="reference")
    decode_sent = sent_by_op(stats)
    cache_before = first.cache.lengths
    with burstattn.comm_stats() as stats:
        second = continue_generation(model, first, more, case.more_tokens, continuation=case.continuation,
                                     backend="reference")
    return dict(tokens=first.tokens, more=second.tokens, mode=second.continuations[0], decode_sent=decode_sent,
                continuation_sent=sent_by_op(stats), lengths_before=cache_before, lengths=second.cache.lengths,
                lengths_after_prefill=lengths_after_prefill, local_bytes=second.cache.local_bytes())


def budget_run(rank: int, world: int, prompt_len: int, budget: int) -> dict:
    """``generate`` under a K/V budget per rank: tokens, or the error message."""
    model = tiny_model(0)
    prompt = prompts(GenCase(world, prompt_len=prompt_len))[0]
    try:
        res = generate(model, prompt, 3, kv_budget_bytes=budget, backend="reference")
    except ValueError as e:
        return dict(error=str(e))
    return dict(tokens=res.tokens, local_bytes=res.cache.local_bytes())


def bad_input(rank: int, world: int, what: str) -> str:
    """One kind of bad input (on one rank, or differing between ranks); returns the error message."""
    model = tiny_model(0)
    prompt = prompts(GenCase(world))[0]
    max_new = 3
    if what == "empty" and rank == world - 1:
        prompt = prompt[:, :0]
    elif what == "negative":
        max_new = -1
    elif what == "differ" and rank == 0:
        prompt = prompt.clone()
        prompt[0, 0] += 1
    elif what == "differ_len" and rank == world - 1:
        prompt = prompt[:, :-1]
    try:
        generate(model, prompt, max_new, backend="reference")
    except ValueError as e:
        return str(e)
    return "no error"

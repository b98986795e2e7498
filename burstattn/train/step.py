"""One optimizer step of a :class:`~burstattn.train.job.Job`: forward, global loss, backward,
gradient sums over replicas, clipping, AdamW, LR schedule."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config import IGNORE_INDEX
from ..parallel import sum_grads
from .dispatch_step import dispatch_forward_backward
from .job import Job, local_batch


@dataclass(frozen=True)
class StepResult:
    """The global figures of one step (the same on every rank)."""

    loss: float
    """Mean next-token cross-entropy over every target token of the global batch."""
    answer_correct: int
    """Answer targets (passkey digits) predicted exactly by the argmax."""
    answer_total: int
    answer_loss: float
    """Mean cross-entropy of the answer targets (``nan`` without any): below ln(10) = 2.30 once the
    model retrieves the key better than chance."""
    grad_norm: float
    lr: float
    tokens: int
    """Tokens of the global batch."""
    host_bytes: int = 0
    """Saved activations this rank copied to host memory in the step (``offload``)."""


def grad_norm(parameters) -> torch.Tensor:
    """The global L2 norm of the gradients: DTensor gradients (FSDP / TP shards) reduce their own
    norms over their meshes; plain tensors are replicated (float32 scalar)."""
    squares = []
    for p in parameters:
        if p.grad is None:
            continue
        n = p.grad.norm(dtype=torch.float32)
        squares.append((n.full_tensor() if hasattr(n, "full_tensor") else n) ** 2)
    return torch.stack(squares).sum().sqrt() if squares else torch.zeros(())


def step_tensors(job: Job, step: int, batch=None) -> tuple[torch.Tensor, torch.Tensor, float, int]:
    """Run step ``step`` (0-based; it selects the data) without reading any tensor on the host:
    ``(stats, norm, lr, host_bytes)`` with ``stats`` the float64 ``[loss, answer hits, answer targets,
    answer cross-entropy]`` summed over the replicas. ``batch``: :func:`~burstattn.train.job.local_batch`'s
    tuple when the caller made it (the dry run makes it before entering the fake mode)."""
    model, cfg = job.model, job.cfg
    if job.dispatcher is not None:  # documents / --dispatch dynamic: every sequence on its own group
        stats, _ = dispatch_forward_backward(job, step)
        norm, lr = _update(job)
        return stats, norm, lr, 0
    tokens, labels, answer, total = local_batch(job, step) if batch is None else batch
    answer = answer & (labels != IGNORE_INDEX)
    # the blockwise loss (LlamaConfig.loss_chunk): [B/dp, N/cp, V] logits exist one chunk at a time
    out = model(tokens, job.positions, labels=labels, total_targets=total, answer=answer)
    loss = out.loss
    loss.backward()
    if not cfg.fsdp:
        sum_grads(model, job.replicas)
    norm, lr = _update(job)
    with torch.no_grad():
        stats = torch.stack([loss.detach().double(), out.answer_hits.double(), answer.sum().double(),
                             out.answer_ce.double()]).to(job.device)
    dist.all_reduce(stats, group=job.replicas)
    return stats, norm, lr, out.host_bytes


def _update(job: Job) -> tuple[torch.Tensor, float]:
    """Clip the summed gradients, step AdamW and the schedule: ``(global grad norm, lr used)``."""
    cfg = job.cfg
    params = [p for p in job.model.parameters() if p.grad is not None]
    norm = grad_norm(params)
    if cfg.grad_clip > 0:
        # as a tensor (clip_grad_norm_'s way): no host sync, and the same float32 product as a Python coefficient
        coef = (cfg.grad_clip / (norm.double() + 1e-6)).clamp(max=1.0)
        for p in params:
            p.grad.mul_(coef)
    lr = job.scheduler.get_last_lr()[0]
    job.optimizer.step()
    job.scheduler.step()
    job.optimizer.zero_grad(set_to_none=True)
    return norm, lr


def train_step(job: Job, step: int) -> StepResult:
    """Run step ``step`` (0-based; it selects the data) and return its global figures."""
    stats, norm, lr, host_bytes = step_tensors(job, step)
    answers = int(stats[2])
    cfg = job.cfg
    return StepResult(float(stats[0]), int(stats[1]), answers, float(stats[3]) / answers if answers else float("nan"),
                      float(norm), lr, cfg.batch * cfg.seq_len, host_bytes)

"""Rank-side functions of the fused-loss tests (module-level so they pickle by reference)."""
from __future__ import annotations

from unittest import mock

import torch

from burstattn.config import IGNORE_INDEX
from burstattn.parallel import sum_grads
from burstattn.train import build_job, train_step
from burstattn.train import job as job_module
from burstattn.train.job import local_batch
from tests.dist.train_cases import full_params


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


def run_cases(rank: int, world: int, cases: list) -> list[dict]:
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

"""Rank-side functions of the training tests (module-level so they pickle by reference)."""
from __future__ import annotations

import torch

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
                params=params if rank == 0 else None)

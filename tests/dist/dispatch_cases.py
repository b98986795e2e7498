"""Rank-side functions of the dispatch tests (module-level so they pickle by reference)."""
from __future__ import annotations

import torch.distributed as dist

from burstattn.train import TrainConfig, build_job, train_step
from tests.dist.train_cases import full_params


def run_many(rank: int, world: int, cfgs: list[TrainConfig]) -> list[dict]:
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

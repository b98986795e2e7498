"""The next-token loss of the GLOBAL batch from sequence shards, and gradient sums over replicas.

The shift is done on the global sequence before sharding (``labels[:, i] = tokens[:, i + 1]``,
the last position ignored), so a shard's last token is scored against its true successor, which
another rank holds. Each rank returns ``sum of its target losses / number of targets of the
global batch``; summed over the ranks that hold different tokens (``dp x cp``) that is the
global mean, not a mean of per-rank means.
"""
from __future__ import annotations

import sys
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..config import IGNORE_INDEX


def shift_labels(tokens: torch.Tensor) -> torch.Tensor:
    """``tokens [B, N]`` (the global sequences) -> ``labels [B, N]``: ``tokens[:, 1:]`` then
    ``IGNORE_INDEX`` at the last position."""
    ignore = torch.full_like(tokens[:, :1], IGNORE_INDEX)
    return torch.cat([tokens[:, 1:], ignore], dim=1)


def sharded_loss(logits: torch.Tensor, labels: torch.Tensor, total_targets: int) -> torch.Tensor:
    """This rank's share of the global mean cross-entropy: ``logits [B, n, V]`` (any float dtype,
    computed in at least float32), ``labels [B, n]`` (``IGNORE_INDEX`` where there is no target) -> scalar
    ``sum(CE over targets) / total_targets``."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # at least float32
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    return ce / total_targets


def sum_grads(model: nn.Module, group) -> None:
    """All-reduce (sum) every gradient over ``group`` (the ``dp x cp`` replicas of unsharded
    weights); tensor-parallel DTensor gradients are summed through their local shards."""
    if group is None or dist.get_world_size(group) == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in model.parameters():
        if p.grad is not None:
            local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            by_dtype.setdefault(local.dtype, []).append(local)
    for grads in by_dtype.values():  # one all-reduce per dtype: a flat bucket
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))


def __getattr__(name: str):
    # names that moved out of this module (the table burstattn.MOVED): resolved, or refused with the new spelling
    return sys.modules["burstattn"].moved_attribute(__name__, name)

"""Rank side of tests/dist/test_hybrid_train.py's float64 check: one forward and backward of hybrid-tiny
in float64 over the context-parallel ranks; the loss and every parameter's gradient (summed over ranks)."""
from __future__ import annotations

import torch
import torch.distributed as dist

import burstattn
from burstattn.models import AttnCall, HybridLlama, preset
from burstattn.models.blockwise import IGNORE


def grads64(rank: int, world: int, strategy: str, layout: str, packed: bool = False) -> dict:
    torch.manual_seed(0)
    cfg = preset("hybrid-tiny").with_overrides(linear_chunk=4)
    model = HybridLlama(cfg, attn=AttnCall(strategy, layout=layout, options={"backend": "reference"})).double()
    N = 24
    tokens = torch.randint(0, cfg.vocab_size, (2, N), generator=torch.Generator().manual_seed(1))
    labels = torch.cat([tokens[:, 1:], torch.full((2, 1), IGNORE)], 1)
    pos = burstattn.sequence_positions(N, layout=layout)
    out = model(tokens[:, pos], pos, labels=labels[:, pos], total_targets=int((labels != IGNORE).sum()))
    out.loss.backward()
    loss = out.loss.detach().clone()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    if world > 1:
        dist.all_reduce(loss)
        for g in grads.values():
            dist.all_reduce(g)
    return dict(loss=float(loss), grads=grads if rank == 0 else None)

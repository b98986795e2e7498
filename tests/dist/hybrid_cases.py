"""Rank side of tests/dist/test_hybrid_train.py's float64 check: one forward and backward of hybrid-tiny
in float64 over the context-parallel ranks; the loss and every parameter's gradient (summed over ranks)."""
from __future__ import annotations

import torch
import torch.distributed as dist

import burstattn
from burstattn.models import AttnCall, HybridLlama, preset
from burstattn.config import IGNORE_INDEX


def grads64(rank: int, world: int, strategy: str, layout: str, packed: bool = False) -> dict:
    torch.manual_seed(0)
    cfg = preset("hybrid-tiny").with_overrides(linear_chunk=4)
    model = HybridLlama(cfg, attn=AttnCall(strategy, layout=layout, options={"backend": "reference"})).double()
    N = 24
    tokens = torch.randint(0, cfg.vocab_size, (2, N), generator=torch.Generator().manual_seed(1))
    labels = torch.cat([tokens[:, 1:], torch.full((2, 1), IGNORE_INDEX)], 1)
    pos = burstattn.sequence_positions(N, layout=layout)
    out = model(tokens[:, pos], pos, labels=labels[:, pos],
                total_targets=int((labels != IGNORE_INDEX).sum()))
    out.loss.backward()
    loss = out.loss.detach().clone()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    if world > 1:
        dist.all_reduce(loss)
        for g in grads.values():
            dist.all_reduce(g)
    return dict(loss=float(loss), grads=grads if rank == 0 else None)


def documents_alone(rank: int, world: int, cfg) -> float:
    """The step-0 loss of ``cfg``'s documents (``--doc-lengths`` / ``--data`` with boundaries) with the
    initial weights ``burstattn train`` builds, each document run alone through the model on one process
    (no packing, no dispatch): the sum of every document's cross-entropy over the batch's targets."""
    from burstattn.train import build_job
    from burstattn.train.dispatch_step import make_documents

    job = build_job(cfg)
    docs = make_documents(cfg).documents(0)
    total = sum(int(d.numel()) - 1 for d in docs)  # a document's last token has no target
    loss = 0.0
    with torch.no_grad():
        for d in docs:
            labels = torch.cat([d[1:], torch.full((1,), IGNORE_INDEX)])
            out = job.model(d[None], torch.arange(d.numel()), attn=AttnCall("burst"), labels=labels[None],
                            total_targets=total)
            loss += float(out.loss)
    return loss

"""``burstattn train --dispatch static|dynamic`` with documents: one step that runs every sequence of
the global batch on the group of ranks :func:`burstattn.parallel.dispatch.plan_dispatch` gave it.

Exactness (the same training as one process): each sequence is its own causal sequence (RoPE
positions from 0, labels shifted inside it, the last token without target); every rank's loss is
``sum of its targets' cross-entropy / targets of the global batch``, backward per micro-batch, then
the gradients are summed over the whole world (DDP's all-reduce, not FSDP: ranks run different
numbers of micro-batches). A sequence over ``d > 1`` ranks is padded at its end to what the layout
splits (pad tokens have no target, and causal queries never see them); sequences at degree 1 that
share a rank are packed into micro-batches of at most ``budget`` tokens with a document mask.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ..comm.agree import agree
from ..comm.groups import degree_groups
from ..config import IGNORE_INDEX, checksum
from ..layouts.named import local_positions, split_error
from ..masks import AttnMask
from ..models import AttnCall
from ..parallel import sum_grads
from ..parallel.dispatch import (DISPATCH_STRATEGIES, MODES, DispatchCost, Placement, divisors,  # noqa: F401
                                 micro_batches, plan_dispatch)
from .config import TrainConfig
from .documents import FileDocs, SyntheticDocs

def uses_dispatch(cfg: TrainConfig) -> bool:
    """Whether ``cfg`` trains through the dispatcher (``--dispatch dynamic`` or a documents source)."""
    return cfg.dispatch == "dynamic" or bool(cfg.doc_lengths) or cfg.eod_id is not None or bool(cfg.doc_offsets)


def dispatch_problem(cfg: TrainConfig, dp: int, cp: int, tp: int, strategy: str) -> Optional[str]:
    """Why ``cfg`` cannot train through the dispatcher (``None``: it can)."""
    if not uses_dispatch(cfg):
        return None
    if strategy not in DISPATCH_STRATEGIES:
        return f"--dispatch / documents run --strategy {' | '.join(DISPATCH_STRATEGIES)}, got {cfg.strategy!r}"
    if cfg.fsdp or tp > 1:
        return ("--dispatch / documents sum gradients over the world (DDP): ranks run different numbers of "
                "micro-batches, so --fsdp and --tp > 1 are not supported with them")
    if cfg.schedule != "ring":
        return f"--dispatch / documents run --schedule ring, got {cfg.schedule!r}"
    if cfg.dispatch == "dynamic" and (cfg.dp not in (None, 1) or cfg.cp is not None):
        return "--dispatch dynamic chooses every sequence's cp degree itself: drop --dp and --cp"
    if (cfg.eod_id is not None or cfg.doc_offsets) and not cfg.data:
        return "--eod-id / --doc-offsets cut a --data file into documents: give --data"
    return None


def make_documents(cfg: TrainConfig):
    """The documents source of ``cfg`` (``None``: rows of the ordinary data)."""
    if cfg.doc_lengths:
        return SyntheticDocs(cfg.doc_lengths, cfg.seed, cfg.batch, cfg.seq_len)
    if cfg.data and (cfg.eod_id is not None or cfg.doc_offsets):
        return FileDocs(cfg.data, cfg.data_format, cfg.seed, cfg.batch, cfg.seq_len, eod_id=cfg.eod_id,
                        offsets=cfg.doc_offsets)
    return None


@dataclass
class Dispatcher:
    """What a dispatched step needs: the mode, the group it dispatches over (the whole world: the batch
    check, the gradient sum), the groups by degree (made once), the cost model, the per-rank token
    budget, the documents source, the attention call's strategy, layout and options."""

    mode: str
    cp: int
    group: dist.ProcessGroup
    groups: dict
    cost: DispatchCost
    budget: Optional[int]
    documents: object
    strategy: str
    layout: str
    options: dict
    head_chunks: int


def build_dispatcher(cfg: TrainConfig, mcfg, cp: int, strategy: str, layout: str, options: Optional[dict],
                     group: dist.ProcessGroup) -> Dispatcher:
    """Every rank of ``group`` (the whole world: its degree groups split it) calls it once (the groups are
    collective)."""
    if cfg.dispatch not in MODES:
        raise ValueError(f"--dispatch must be one of {MODES}, got {cfg.dispatch!r}")
    world = dist.get_world_size(group)
    degrees = divisors(world) if cfg.dispatch == "dynamic" else [1, cp]
    cost = DispatchCost.for_model(mcfg.dim, mcfg.n_layers, mcfg.n_heads, mcfg.n_kv_heads, mcfg.head_dim, mcfg.ffn_dim,
                                  mcfg.vocab_size)
    return Dispatcher(cfg.dispatch, cp, group, degree_groups(degrees), cost, cfg.dispatch_budget,
                      make_documents(cfg), strategy, layout, dict(options or {}), cfg.head_chunks)


def global_sequences(job, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The step's sequences ``(tokens [L], answer [L] bool)``: the documents, or the batch's rows."""
    source = job.dispatcher.documents
    if source is not None:
        return [(d, torch.zeros(d.numel(), dtype=torch.bool)) for d in source.documents(step)]
    batch = job.data.batch(step)
    return list(zip(batch.tokens.unbind(0), batch.answer.unbind(0)))


def check_same_batch(lengths: list[int], group: Optional[dist.ProcessGroup]) -> None:
    """Refuse, on every rank of ``group``, a global batch whose sequence lengths differ across ranks."""
    crc = checksum(torch.tensor(lengths, dtype=torch.int64))
    agree("dispatch", [("the global batch (sequences and lengths)", f"{len(lengths)} sequences, crc32 {crc:08x}")],
          group, hint="the ranks hold different global batches (sequences and lengths must be equal on every rank)")


def _labels(tokens: torch.Tensor, answer: torch.Tensor, targets: str) -> torch.Tensor:
    labels = torch.cat([tokens[1:], torch.full((1,), IGNORE_INDEX, dtype=tokens.dtype)])
    return labels.masked_fill(~answer, IGNORE_INDEX) if targets == "answer" else labels


def _call(job, mb: list[Placement], seqs, labels):
    """``(tokens [1, n], positions [n], labels [1, n], answer [1, n], attn)`` of one micro-batch."""
    disp = job.dispatcher
    if mb[0].degree == 1:
        tokens = torch.cat([seqs[p.seq][0] for p in mb])
        lab = torch.cat([labels[p.seq] for p in mb])
        ans = torch.cat([seqs[p.seq][1] for p in mb])
        positions = torch.cat([torch.arange(p.length) for p in mb])
        opts = dict(disp.options)
        if len(mb) > 1:
            cu = torch.tensor([0] + [p.length for p in mb]).cumsum(0)
            opts["mask"] = AttnMask(cu_seqlens=cu)
        attn = AttnCall(disp.strategy, disp.groups[1], "contiguous", opts, disp.head_chunks)
    else:
        p = mb[0]
        tok, ans = seqs[p.seq]
        step = p.degree * (2 if disp.layout == "zigzag" else 1)
        pad = -p.length % step
        tok = torch.cat([tok, torch.zeros(pad, dtype=tok.dtype)])
        lab = torch.cat([labels[p.seq], torch.full((pad,), IGNORE_INDEX, dtype=tok.dtype)])
        ans = torch.cat([ans, torch.zeros(pad, dtype=torch.bool)])
        err = split_error(p.length + pad, p.degree, disp.layout)
        if err:
            raise ValueError(f"dispatch: {err}")
        positions = local_positions(p.length + pad, dist.get_rank(disp.group) - p.ranks.start, p.degree, disp.layout)
        tokens, lab, ans = tok[positions], lab[positions], ans[positions]
        attn = AttnCall(disp.strategy, disp.groups[p.degree], disp.layout, dict(disp.options), disp.head_chunks)
    dev = job.device
    return tokens[None].to(dev), positions.to(dev), lab[None].to(dev), ans[None].to(dev), attn


def dispatch_forward_backward(job, step: int) -> tuple[torch.Tensor, dict]:
    """This rank's micro-batches of step ``step``, forward and backward (gradients accumulate in
    ``.grad``), then summed over the world. Returns the world-summed float64 ``[loss, answer hits,
    answer targets, answer cross-entropy]`` and the plan's figures."""
    disp, cfg, model = job.dispatcher, job.cfg, job.model
    seqs = global_sequences(job, step)
    lengths = [int(t.numel()) for t, _ in seqs]
    check_same_batch(lengths, disp.group)
    plan = plan_dispatch(lengths, dist.get_world_size(disp.group), disp.cost, mode=disp.mode, cp=disp.cp,
                         budget=disp.budget)
    labels = [_labels(t, a, cfg.targets) for t, a in seqs]
    total = sum(int((lab != IGNORE_INDEX).sum()) for lab in labels)
    stats = torch.zeros(4, dtype=torch.float64)
    cap = disp.budget or cfg.seq_len
    for mb in micro_batches(plan.of_rank(dist.get_rank(disp.group)), cap):
        tokens, positions, lab, ans, attn = _call(job, mb, seqs, labels)
        out = model(tokens, positions, attn=attn, labels=lab, total_targets=max(total, 1),
                    answer=ans & (lab != IGNORE_INDEX))
        out.loss.backward()
        stats += torch.stack([out.loss.detach().double().cpu(), out.answer_hits.double().cpu(),
                              (ans & (lab != IGNORE_INDEX)).sum().double().cpu(), out.answer_ce.double().cpu()])
    for p in model.parameters():  # a rank without work (or a parameter unused) still joins the sum
        if p.grad is None and p.requires_grad:
            p.grad = torch.zeros_like(p)
    sum_grads(model, disp.group)
    stats = stats.to(job.device)
    dist.all_reduce(stats, group=disp.group)
    return stats, dict(balance=plan.balance, degrees=plan.degrees, loads=plan.loads, sequences=len(lengths))

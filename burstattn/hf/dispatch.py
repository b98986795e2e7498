"""``ContextParallelTrainer(dispatch="dynamic")``: every sequence of a Hugging Face global batch on the
group of ranks :func:`burstattn.parallel.dispatch.plan_dispatch` gives it (the dispatcher of
``burstattn train --dispatch dynamic``; no second one).

Every rank holds the whole global batch (the Trainer's dataloader as for one process). Its sequences
are the documents of packed rows (``position_ids`` restarts, ``cu_seq_lens_q``, ``seq_idx``), the real
tokens of padded rows (``attention_mask``), or the rows themselves. Each gets a degree ``d`` (a divisor of
the world) and one of the aligned groups of that degree (:func:`burstattn.comm.groups.degree_groups`, made once);
a rank runs its sequences in plan order: those at ``d > 1`` one per forward, sharded over their group
(a document-balanced partition, or the registered layout), those at ``d = 1`` packed into micro-batches of at
most ``budget`` tokens (default: the longest sequence) with a document mask.

Exactness (the fixed-mesh and the one-process training): the targets are shifted on the caller's rows
before the cut (a document's last token keeps the target its row gives it), the rotary positions are the
caller's, every forward's loss is ``its targets' cross-entropy sum / targets of the global batch`` (the
Trainer's ``num_items_in_batch``), and at the optimizer step the gradients are summed over the whole world
(one flat all-reduce per dtype; accumulation steps accumulate locally first). The forwards go to the
unwrapped model: DDP's reducer expects one backward per rank and step, which different numbers of
micro-batches per rank cannot give.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

import torch
import torch.distributed as dist

from ..comm.groups import degree_groups, group_context
from ..config import IGNORE_INDEX
from ..layouts.named import local_positions
from ..parallel.dispatch import DispatchCost, Placement, divisors, micro_batches, plan_dispatch
from ..strategies import STRATEGIES
from .batch import SHARD_KEY, ShardSpec, batch_kwargs, checked_plan, place, sync_gradients
from .packing import BatchPlan, flatten_rows, rope_positions, shifted_labels

FN = "ContextParallelTrainer(dispatch='dynamic')"


@dataclass(frozen=True)
class Sequence:
    """One sequence of the global batch: ``ids [L]``, ``targets [L]`` (each token's next-token label,
    already shifted on the caller's row; -100 none) and ``positions [L]`` (its rotary positions)."""

    ids: torch.Tensor
    targets: torch.Tensor
    positions: torch.Tensor


def batch_sequences(inputs: Mapping, group: Optional[dist.ProcessGroup] = None) -> list[Sequence]:
    """The sequences of a collated batch (module docstring). ``ValueError`` on every rank of ``group``
    for bad input or a batch that differs across its ranks; pad runs are left out (no target, and no
    real token attends to a pad)."""
    kw = batch_kwargs(inputs, FN)
    ids, labels = kw.pop("input_ids"), kw.pop("labels")
    if labels is None:
        raise ValueError(f"{FN}: the training batch has no labels")
    plan = checked_plan(FN, ids, labels, **kw, group=group)
    flat = flatten_rows(ids.detach().cpu(), plan, 0)  # [rows, T]
    targets = shifted_labels(labels.detach().cpu(), plan)
    rope = rope_positions(kw["position_ids"], plan)
    if not plan.flattened:
        return [Sequence(flat[r], targets[r], rope[r]) for r in range(plan.rows)]
    cu = plan.cu_seqlens().tolist()
    pads = None if plan.pads is None else plan.pads.reshape(-1)
    return [Sequence(flat[0, a:b], targets[0, a:b], rope[0, a:b]) for a, b in zip(cu[:-1], cu[1:])
            if pads is None or not bool(pads[a:b].all())]


def count_targets(batches: list, group: Optional[dist.ProcessGroup] = None) -> int:
    """Targets of the global batch (every accumulation step's): the same on every rank, no collective
    beyond each batch's equality check."""
    return sum(int((s.targets != IGNORE_INDEX).sum()) for b in batches for s in batch_sequences(b, group))


def cost_of(config) -> DispatchCost:
    """:meth:`DispatchCost.for_model` of a transformers config (LLaMA-style names)."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return DispatchCost.for_model(config.hidden_size, config.num_hidden_layers, heads,
                                  getattr(config, "num_key_value_heads", None) or heads, head_dim,
                                  getattr(config, "intermediate_size", None) or 4 * config.hidden_size,
                                  config.vocab_size)


class DynamicDispatch:
    """The dispatcher of one trainer: the groups of every degree (made here, collectively: every rank
    builds it at the same point), the cost model, the per-rank token budget and the attention's
    registration (``name``, ``layout``, strategy)."""

    def __init__(self, config, *, name: str, strategy: str, layout=None, budget: Optional[int] = None,
                 cost: Optional[DispatchCost] = None) -> None:
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise ValueError(f"{FN}: dispatch_budget must be a positive int (tokens per rank), got {budget!r}")
        if cost is not None and not isinstance(cost, DispatchCost):
            raise ValueError(f"{FN}: dispatch_cost must be a burstattn.parallel.dispatch.DispatchCost, got "
                             f"{type(cost).__name__}")
        self.world = group_context(None).world_size
        self.rank = group_context(None).rank
        self.groups = degree_groups(divisors(self.world))
        self.cost = cost_of(config) if cost is None else cost
        self.budget, self.name, self.layout, self.spec = budget, name, layout, STRATEGIES[strategy]
        self.last_plan = None  # the latest step's DispatchPlan (degrees, balance: for logs and tests)

    def micro_batch(self, seqs: list[Sequence], mb: list[Placement], device) -> dict:
        """The model kwargs of one micro-batch (one sequence over its group, or a run of degree-1 ones)."""
        degree, first = mb[0].degree, mb[0].ranks.start
        parts = [seqs[p.seq] for p in mb]
        n = sum(p.length for p in mb)
        starts = torch.tensor([0] + [p.length for p in mb[:-1]], dtype=torch.int64).cumsum(0)
        plan, layout = place(BatchPlan(1, n, True, n, starts, None), self.layout, self.spec, degree)
        pos = local_positions(plan.row_len, self.rank - first, degree, layout)
        ids = flatten_rows(torch.cat([s.ids for s in parts])[None], plan, 0)[:, pos]
        targets = flatten_rows(torch.cat([s.targets for s in parts])[None], plan, IGNORE_INDEX)[:, pos]
        rope = rope_positions(torch.cat([s.positions for s in parts])[None], plan)[:, pos]
        shard = ShardSpec(layout, plan, self.rank - first, degree, pos, name=self.name, group=self.groups[degree])
        targets = targets.to(device)
        return {"input_ids": ids.to(device), "position_ids": rope.to(device), "labels": targets,
                "shift_labels": targets, SHARD_KEY: shard}

    def training_step(self, trainer, model, inputs: Mapping, num_items_in_batch=None) -> torch.Tensor:
        """One accumulation step of ``trainer`` (a ``transformers.Trainer`` with the mixin): this rank's
        micro-batches forward and backward, the gradients summed over the world at the optimizer step.
        Returns this rank's loss share times the world size (the Trainer logs the mean over ranks: the
        global batch's mean loss, as under DDP)."""
        seqs = batch_sequences(inputs)
        count = num_items_in_batch  # the Trainer's int64 count, as the static path divides by it
        if count is None:  # one batch's mean; the accumulation steps share the optimizer step
            count = sum(int((s.targets != IGNORE_INDEX).sum()) for s in seqs) * trainer.current_gradient_accumulation_steps
        count = torch.as_tensor(count, device=trainer.args.device).clamp(min=1)
        plan = plan_dispatch([int(s.ids.numel()) for s in seqs], self.world, self.cost, mode="dynamic",
                             budget=self.budget)
        self.last_plan = plan
        inner = trainer.accelerator.unwrap_model(model)
        inner.train()
        total = torch.zeros((), device=trainer.args.device)
        cap = self.budget or max(p.length for p in plan.placements)
        for mb in micro_batches(plan.of_rank(self.rank), cap):
            batch = self.micro_batch(seqs, mb, trainer.args.device)
            with trainer.compute_loss_context_manager():
                loss = inner(**batch, num_items_in_batch=count).loss
            batch[SHARD_KEY].check_attended("the loss")
            trainer.accelerator.backward(loss)
            total = total + loss.detach()
        if trainer.accelerator.sync_gradients:  # the optimizer step: every rank's shares, summed
            sync_gradients(inner, None)
        return total * self.world

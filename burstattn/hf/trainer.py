"""``transformers.Trainer`` with context parallelism: :class:`ContextParallelMixin` and :class:`ContextParallelTrainer`.

The world is a ``dp x cp`` mesh (``cp_size`` ranks per data-parallel replica). What the mixin changes,
and nothing else:

* data: the Trainer's dataloader (accelerate's ``BatchSamplerShard``) is re-pointed from ``world`` to
  ``dp`` replicas, so every cp rank of a replica gets the SAME batch, the same one a plain Trainer with
  ``dp`` processes would give that replica;
* batch: each batch is cut by :func:`burstattn.hf.shard_inputs` for the cp group (packed
  documents, padding, global label shift) before transformers counts ``num_items_in_batch``;
* loss and gradients: ``num_items_in_batch`` is the global target count (one all-reduce), so every
  rank's loss is ``its shard's token-loss sum / global count``, scaled by the world size exactly as
  transformers does under DDP; DDP's average over ``dp x cp`` then gives the single-process gradient
  (no double counting), and the logged loss (the mean over ranks) is the single-process loss;
* attention: the model's ``attn_implementation`` becomes burstattn's over the cp group
  (:func:`burstattn.hf.register` under ``attn_implementation``, default ``"burst_cp"``); ``save_model``
  writes the model's original implementation;
* evaluation and ``predict``: the loss is made equal on the cp ranks of a replica and the logits are
  gathered over cp, then metrics are gathered over the replicas only. As with plain DDP, accelerate
  repeats samples to even out the last batch over dp > 1 replicas, and those repeats count in that
  batch's loss: the evaluation loss is the single-process one when the evaluation set is a multiple of
  ``dp x per_device_eval_batch_size`` (always at dp = 1).

``dispatch="dynamic"``: every sequence of the global batch its own cp degree and group
(:mod:`burstattn.hf.dispatch`).

Refused with ``ValueError`` (on every rank, at construction): a world not divisible by ``cp_size``,
label smoothing, ``compute_loss_func`` (both shift labels themselves), models whose forward takes no
loss kwargs, iterable datasets dispatched by accelerate.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from transformers import Trainer

from ..config import IGNORE_INDEX
from .attention import register
from .families import check_model
from .hybrid import patch_mixers
from .batch import SHARD_KEY, gather_logits, shard_inputs



class ContextParallelMixin:
    """Context parallelism for any ``transformers.Trainer`` subclass: put it first in the bases,
    ``class SFT(ContextParallelMixin, trl.SFTTrainer): ...``.

    Args (keyword-only, before the Trainer's own):
        cp_size: ranks that share one sequence (default: the world). ``world % cp_size == 0``.
        strategy: a :data:`burstattn.strategies.STRATEGIES` name (default ``"burst"``).
        layout: ``None`` (a document-balanced partition for packed or padded batches, else the
            strategy's default) or a layout name.
        attn_implementation: the name registered with transformers (default ``"burst_cp"``).
        backend: local attention kernel (default ``"auto"``).
        dispatch: ``"static"`` (the fixed ``dp x cp`` mesh) or ``"dynamic"``: every rank loads the whole
            global batch (``per_device_train_batch_size`` rows per step, as one process) and every sequence
            of it (a packed row's documents, a padded row's real tokens, a row) gets its own cp degree and
            group of ranks from :func:`burstattn.parallel.dispatch.plan_dispatch`, as in ``burstattn train
            --dispatch dynamic`` (:mod:`burstattn.hf.dispatch`); the training equals the static and the
            one-process one. Strategies ``burst``, ``ring``, ``allgather``; no ``cp_size``; evaluation runs
            over the whole world as ``cp_size=world``.
        dispatch_budget: ``"dynamic"``: tokens a rank may hold of one sequence (``None``: no limit).
        dispatch_cost: ``"dynamic"``: a :class:`burstattn.parallel.dispatch.DispatchCost` (default: from
            the model's config, :func:`burstattn.hf.dispatch.cost_of`).
        **strategy_options: the strategy's own options (``ulysses_degree``, ``backward``, ...).
    """

    def __init__(self, *args, cp_size: Optional[int] = None, strategy: str = "burst", layout=None,
                 attn_implementation: str = "burst_cp", backend: str = "auto", strategy_options: Optional[dict] = None,
                 dispatch: str = "static", dispatch_budget: Optional[int] = None, dispatch_cost=None,
                 **kwargs) -> None:
        _check_dispatch(dispatch, cp_size, strategy, dispatch_budget, dispatch_cost)
        self.dispatch = dispatch
        super().__init__(*args, **kwargs)
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        cp = world if cp_size is None else cp_size
        if not isinstance(cp, int) or isinstance(cp, bool) or cp < 1 or world % cp:
            raise ValueError(f"ContextParallelTrainer: cp_size must be a positive divisor of the world size {world}, "
                             f"got {cp_size!r}")
        self._refuse_unsupported()
        self.cp_size, self.dp_size = cp, world // cp
        self.cp_group, self.dp_rank, self.cp_rank = None, 0, 0
        if world > 1:
            from torch.distributed.device_mesh import init_device_mesh

            kind = "cuda" if self.args.device.type == "cuda" else "cpu"
            self.mesh = init_device_mesh(kind, (self.dp_size, cp), mesh_dim_names=("dp", "cp"))
            self.cp_group = self.mesh["cp"].get_group()
            self.dp_rank, self.cp_rank = self.mesh.get_coordinate()
        self.cp_attn_implementation = attn_implementation
        self.cp_options = register(attn_implementation, strategy=strategy, layout=layout, backend=backend,
                                   group=self.cp_group, **(strategy_options or {}))
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model  # PEFT
        self._original_attn = getattr(base.config, "_attn_implementation", None)
        base.set_attn_implementation(attn_implementation)
        patch_mixers(base)  # hybrid models: their mixers' recurrences sequence parallel (burstattn/hf/hybrid.py)
        check_model(base)  # a model that never calls the registered attention would train silently wrong
        self.dispatcher = None
        if dispatch == "dynamic":  # the degree groups: collective, every rank at this point
            from .dispatch import DynamicDispatch

            self.dispatcher = DynamicDispatch(base.config, name=attn_implementation, strategy=strategy, layout=layout,
                                              budget=dispatch_budget, cost=dispatch_cost)

    def _refuse_unsupported(self) -> None:
        problem = None
        if self.args.label_smoothing_factor:
            problem = "label smoothing shifts labels itself; it is not supported with context parallelism"
        elif self.compute_loss_func is not None:
            problem = ("compute_loss_func shifts labels itself; with context parallelism the model's own loss "
                       "(labels shifted on the global sequence) is used")
        elif not self.model_accepts_loss_kwargs:
            problem = "the model's forward takes no loss kwargs (num_items_in_batch): its loss cannot be made exact"
        elif self.dispatch == "dynamic" and _overrides(type(self), ("compute_loss", "training_step")):
            problem = (f"dispatch='dynamic' runs the model's own loss on each rank's sequences; {type(self).__name__} "
                       f"overrides {' and '.join(_overrides(type(self), ('compute_loss', 'training_step')))}, which "
                       "it would bypass: use dispatch='static'")
        if problem:
            raise ValueError(f"ContextParallelTrainer: {problem}")

    # ---- data: every cp rank of a replica gets the replica's batch
    def _replica_dataloader(self, dataloader):
        from accelerate.data_loader import BatchSamplerShard, DataLoaderDispatcher, IterableDatasetShard

        if isinstance(dataloader, DataLoaderDispatcher):
            raise ValueError("ContextParallelTrainer: accelerate dispatches this dataset's batches from rank 0 "
                             "(an iterable dataset); give a map-style dataset (with __len__)")
        sampler = getattr(dataloader, "batch_sampler", None)
        if isinstance(sampler, BatchSamplerShard):
            sampler.num_processes, sampler.process_index = self.dp_size, self.dp_rank
            # one replica: the batches of one process, the last one left short (as without accelerate)
            sampler.even_batches = sampler.even_batches and self.dp_size > 1
        dataset = getattr(dataloader, "dataset", None)
        if isinstance(dataset, IterableDatasetShard):
            dataset.num_processes, dataset.process_index = self.dp_size, self.dp_rank
        return dataloader

    def get_train_dataloader(self):
        return self._replica_dataloader(super().get_train_dataloader())

    def get_eval_dataloader(self, eval_dataset=None):
        return self._replica_dataloader(super().get_eval_dataloader(eval_dataset))

    def get_test_dataloader(self, test_dataset):
        return self._replica_dataloader(super().get_test_dataloader(test_dataset))

    def get_cp_size(self) -> int:
        """Ranks that share a batch (transformers uses it for the global batch size)."""
        return self.cp_size

    # ---- batches: sharded before anything counts them
    def _cp_shard(self, inputs):
        if SHARD_KEY in inputs:
            return inputs
        extra = {k: inputs[k] for k in ("use_cache", "return_loss") if k in inputs}
        batch = shard_inputs({k: v for k, v in inputs.items() if k not in extra}, group=self.cp_group,
                             name=self.cp_attn_implementation)
        batch.pop("num_items_in_batch", None)  # the Trainer passes its own (global) count
        return {**batch, **extra}

    def get_batch_samples(self, epoch_iterator, num_batches: int, device):
        batches = []
        for _ in range(num_batches):
            try:
                batch = next(epoch_iterator)
            except StopIteration:
                break
            batches.append(batch if self.dispatcher else self._cp_shard(batch))
        if self.dispatcher and batches:  # every rank holds the global batch: its count, no all-reduce
            from .dispatch import count_targets

            return batches, torch.tensor(count_targets(batches), dtype=torch.int64, device=device)
        return batches, self._get_num_items_in_batch(batches, device)

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.dispatcher is None:
            return super().training_step(model, inputs, num_items_in_batch)
        return self.dispatcher.training_step(self, model, inputs, num_items_in_batch)

    def _prepare_inputs(self, inputs):
        return super()._prepare_inputs(self._cp_shard(inputs))

    def _get_num_items_in_batch(self, batch_samples: list, device):
        """The number of targets of the global batch (every dp replica, every accumulation step) when
        ``average_tokens_across_devices``, else of this replica: the shards partition the targets, so
        one all-reduce of the shards' counts."""
        if not batch_samples or "shift_labels" not in batch_samples[0]:
            return None
        count = sum(int((b["shift_labels"] != IGNORE_INDEX).sum()) for b in batch_samples)
        total = torch.tensor(count, dtype=torch.int64, device=device)
        if dist.is_available() and dist.is_initialized():
            group = None if self.args.average_tokens_across_devices else self.cp_group
            dist.all_reduce(total, group=group)
        return total

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        counted = getattr(self, "_total_train_tokens", None)  # TRL's token count, before its update
        out = super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        shard = inputs.get(SHARD_KEY)
        if shard is not None:
            shard.check_attended("the loss")
            if counted is not None and getattr(self, "_total_train_tokens", None) != counted:
                self._count_real_tokens(inputs, shard, counted)
        if self.args.average_tokens_across_devices or num_items_in_batch is None or self.cp_size == 1:
            return out
        # per-replica counts: DDP averages over dp x cp ranks, the replica's loss is the sum over its cp ranks
        return (out[0] * self.cp_size, out[1]) if return_outputs else out * self.cp_size

    def _count_real_tokens(self, inputs, shard, before: int) -> None:
        """TRL adds each rank's ``position_ids.size(1)`` (or ``attention_mask.sum()``), gathered over every
        process, to ``_total_train_tokens``: over a replica's cp ranks that is the layout's padded length.
        Replace this step's addition by the replica's real tokens (cp rank 0 counts them), summed over
        the world (one all-reduce of an int)."""
        mine = torch.tensor(shard.tokens if self.cp_rank == 0 else 0, dtype=torch.int64, device=self.args.device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(mine)
        self._total_train_tokens = before + int(mine)
        metrics = getattr(self, "_metrics", None)
        if isinstance(metrics, dict) and isinstance(metrics.get("train"), dict) and "num_tokens" in metrics["train"]:
            metrics["train"]["num_tokens"] = [self._total_train_tokens]

    # ---- evaluation and predict
    def prediction_step(self, model, inputs, prediction_loss_only: bool, ignore_keys=None):
        full_labels = None
        if self.label_names and all(inputs.get(k) is not None for k in self.label_names):
            full_labels = tuple(inputs[k] for k in self.label_names)
            full_labels = full_labels[0] if len(full_labels) == 1 else full_labels
        sharded = self._cp_shard(inputs)
        loss, logits, _ = super().prediction_step(model, sharded, prediction_loss_only, ignore_keys)
        sharded[SHARD_KEY].check_attended("the evaluation loss and logits")
        if loss is not None and self.cp_size > 1:
            loss = loss.detach().clone().to(self.args.device)
            dist.all_reduce(loss, group=self.cp_group)  # the same value on the replica's cp ranks
            loss = loss / self.cp_size
        if logits is not None:
            shard = sharded[SHARD_KEY]
            n = shard.positions.numel()

            def full(x):
                if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[1] == n:
                    return gather_logits(x, group=self.cp_group, shard=shard)
                return x

            logits = tuple(full(x) for x in logits) if isinstance(logits, tuple) else full(logits)
        return loss, logits, full_labels

    def evaluation_loop(self, *args, **kwargs):
        # the Trainer resets gather_function to accelerate's after every loop: set ours for each
        self.gather_function = self._gather_for_metrics
        return super().evaluation_loop(*args, **kwargs)

    def _gather_for_metrics(self, data, use_gather_object: bool = False):
        """accelerate's ``gather_for_metrics`` over the dp replicas only (the cp ranks of a replica
        hold the same values): gather over the world, keep the cp-rank-0 chunks, drop the remainder."""
        from accelerate.utils import gather, gather_object, recursively_apply

        world = self.dp_size * self.cp_size
        if world == 1:
            return data
        leaders = [i * self.cp_size for i in range(self.dp_size)]
        try:
            recursively_apply(lambda x: x, data, error_on_other_type=True)
            tensors = not use_gather_object
        except TypeError:
            tensors = False
        if tensors:
            def pick(t):  # [world * b, ...] -> [dp * b, ...]
                return t.reshape(world, -1, *t.shape[1:])[leaders].reshape(-1, *t.shape[1:])

            data = recursively_apply(pick, gather(data))
        else:
            items = list(data) if isinstance(data, (list, tuple)) else [data]
            every = gather_object(items)
            data = [x for r in leaders for x in every[r * len(items):(r + 1) * len(items)]]
        state = self.accelerator.gradient_state
        if state.end_of_dataloader and state.remainder > 0:
            data = recursively_apply(lambda t: t[:state.remainder], data) if tensors else data[:state.remainder]
        return data

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """As the Trainer's, with the model's original ``attn_implementation`` in the saved config."""
        model = self.accelerator.unwrap_model(self.model)
        model = model.get_base_model() if hasattr(model, "get_base_model") else model
        restore = self._original_attn not in (None, self.cp_attn_implementation)
        if restore:
            model.config._attn_implementation = self._original_attn
        try:
            super().save_model(output_dir, _internal_call=_internal_call)
        finally:
            if restore:
                model.config._attn_implementation = self.cp_attn_implementation


def _check_dispatch(dispatch, cp_size, strategy: str, budget, cost) -> None:
    from ..parallel.dispatch import DISPATCH_STRATEGIES, MODES

    problem = None
    if dispatch not in MODES:
        problem = f"dispatch must be one of {MODES}, got {dispatch!r}"
    elif dispatch == "dynamic" and cp_size is not None:
        problem = f"dispatch='dynamic' chooses every sequence's cp degree itself: drop cp_size (got {cp_size!r})"
    elif dispatch == "dynamic" and strategy not in DISPATCH_STRATEGIES:
        problem = f"dispatch='dynamic' runs strategy {' | '.join(DISPATCH_STRATEGIES)}, got {strategy!r}"
    elif dispatch == "static" and (budget is not None or cost is not None):
        problem = "dispatch_budget and dispatch_cost are options of dispatch='dynamic'"
    if problem:
        raise ValueError(f"ContextParallelTrainer: {problem}")


def _overrides(cls, names: tuple) -> list:
    """The methods of ``names`` that a class of ``cls``'s MRO other than the mixin and ``Trainer`` defines."""
    return [n for n in names if any(n in c.__dict__ for c in cls.__mro__
                                    if c not in (ContextParallelMixin, Trainer, object))]


class ContextParallelTrainer(ContextParallelMixin, Trainer):
    """``transformers.Trainer`` with burstattn context parallelism (see :class:`ContextParallelMixin`):
    ``ContextParallelTrainer(model=..., args=..., train_dataset=..., cp_size=2, strategy="burst")``."""

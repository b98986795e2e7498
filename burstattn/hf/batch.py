"""Sequence-parallel batches for transformers models: shard, sum gradients, gather logits.

Every rank calls :func:`shard_batch` with the SAME full batch (checked: one small all-gather); it
returns this rank's model kwargs, including a :class:`ShardSpec` under ``burst_shard`` that tells the
attention function where the tokens are and which documents they belong to. ``model(**batch).loss``
is then the single-process loss on every rank, and its backward gives this rank's share of the
gradients: :func:`sync_gradients` sums the shares.

Packed documents (``position_ids`` from ``DataCollatorWithFlattening``, or ``cu_seq_lens_q/k``) and
padding (a 2-D ``attention_mask``) become burstattn's document mask (:mod:`.packing`): no token attends
across a document, rotary positions restart per document, padded keys are never attended, a pad gives
no loss. Such batches are laid out as one sequence and sharded with a document-balanced partition
(:func:`burstattn.document_partition`) when the registered layout is ``None``.
"""
from __future__ import annotations

from typing import Mapping, Optional

import torch
import torch.distributed as dist

from ..comm.agree import agree
from ..comm.groups import group_context
from ..config import IGNORE_INDEX, checksum
from ..layouts.named import gather_sequence, layout_or_default, local_positions
from ..layouts.partition import document_partition
from ..masks import AttnMask
from ..strategies import STRATEGIES
from .families import check_model, registration
from .guard import calling_model, running_model_problem
from .packing import BatchPlan, flatten_rows, plan_batch, rope_positions, shifted_labels

SHARD_KEY = "burst_shard"  # the model kwarg that carries the ShardSpec to the attention function
# collated keys shard_batch understands (max_length_* are flash-attn's and only describe cu_seq_lens)
# (TRL's padding-free collator adds seq_idx, the document index of every token of a packed row)
BATCH_KEYS = ("input_ids", "labels", "attention_mask", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k",
              "max_length_q", "max_length_k", "seq_idx")


class _SumOverRanks(torch.autograd.Function):
    """Forward: all-reduce (sum) of a loss share; backward: identity, so each rank's backward gives
    the gradient of its own share and the shares' gradients sum to the total's."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        out = x.detach().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class GlobalItemCount(torch.Tensor):
    """The global number of target tokens, passed to transformers as ``num_items_in_batch``.

    transformers' loss is ``sum_of_local_token_losses / num_items_in_batch``. Dividing by this
    count also sums the local shares over the group (:class:`_SumOverRanks`), so every rank's
    ``loss`` is the single-process mean while its gradient stays this rank's share. Any other
    operation treats it as the plain float32 scalar ``count``.
    """

    group: Optional[dist.ProcessGroup]
    world_size: int
    shard: Optional["ShardSpec"]

    @staticmethod
    def __new__(cls, count: int, group: Optional[dist.ProcessGroup], world_size: int,
                shard: Optional["ShardSpec"] = None) -> "GlobalItemCount":
        obj = torch.Tensor._make_subclass(cls, torch.tensor(float(count)))
        obj.group, obj.world_size, obj.shard = group, world_size, shard
        return obj

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        divides = func in (torch.Tensor.div, torch.Tensor.__truediv__, torch.div, torch.true_divide)
        if divides and len(args) == 2 and isinstance(args[1], cls) and not isinstance(args[0], cls):
            share, count = args
            if count.shard is not None:  # the loss of a shard_batch batch: did burstattn's attention see it?
                count.shard.check_attended("the loss")
            total = share if count.world_size == 1 else _SumOverRanks.apply(share, count.group)
            return total / count.as_subclass(torch.Tensor).to(total.device)
        if func is torch.Tensor.to and isinstance(args[0], cls) and args[0].device == torch.device("cpu"):
            return args[0]
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


class ShardSpec:
    """Where this rank's tokens of a :func:`shard_batch` batch sit (passed to the model as ``burst_shard``).

    Attributes:
        layout: the layout (name or :class:`~burstattn.layouts.partition.Partition`) of the global sequence.
        plan: the :class:`~burstattn.hf.packing.BatchPlan` (rows, padding, documents).
        rank, world_size: this rank in the group the batch was sharded for.
        positions: this rank's global positions ``[n]`` in a row of the sharded batch.
        cu_seqlens: document boundaries over the flattened sequence, or ``None`` (rows kept).
        group: the group the batch was sharded over, when not the registered one (dynamic dispatch:
            :mod:`burstattn.hf.dispatch` gives every micro-batch its own group), else ``None``.
    Not a dataclass on purpose: wrappers such as DDP pass plain objects through untouched.
    """

    def __init__(self, layout, plan: BatchPlan, rank: int, world_size: int, positions: torch.Tensor,
                 name: str = "burst", group: Optional[dist.ProcessGroup] = None) -> None:
        self.layout, self.plan, self.rank, self.world_size = layout, plan, rank, world_size
        self.positions, self.name, self.group = positions, name, group
        self.attended = False  # set by burstattn's attention function when a layer runs on this batch
        self.cu_seqlens = plan.cu_seqlens()
        self._masks: dict = {}

    @property
    def tokens(self) -> int:
        """Real tokens of the caller's batch: ``B * N`` less the padding (the layout's pads excluded)."""
        pads = 0 if self.plan.pads is None else int(self.plan.pads.sum())
        return self.plan.batch * self.plan.length - pads

    def check_attended(self, what: str) -> None:
        """Raise ``ValueError`` if no layer of the forward ran burstattn's attention on this batch: the
        model's attention implementation is not a burstattn registration (each rank attended within
        its own shard only). ``what``: the result about to be taken (``"the loss"``, ...)."""
        if not self.attended:
            running = calling_model()  # inside the model's forward (its loss): check_model's message first
            problem = None if running is None else running_model_problem(running[0])
            if problem:
                raise ValueError(problem)
            raise ValueError(f"burstattn.hf: {what} of a shard_batch batch (attn_implementation {self.name!r}) comes "
                             f"from a forward in which no attention layer ran burstattn: the model's attention "
                             f"implementation is not a function registered with burstattn.hf.register (e.g. "
                             f"from_pretrained(DIR) keeps 'sdpa'), so every rank attended within its own shard only. "
                             f"Build the model with attn_implementation={self.name!r} or call "
                             f"model.set_attn_implementation({self.name!r}); burstattn.hf.check_model(model) says "
                             f"what else a model needs")

    @property
    def seq_len(self) -> int:
        """Length of one row of the global (sharded) batch."""
        return self.plan.row_len

    def mask(self, window: Optional[int]) -> Optional[AttnMask]:
        """The document mask, with a causal sliding ``window`` (keys back) if given; one
        :class:`~burstattn.AttnMask` per window, built once and shared by every layer (its block
        summaries are cached in it). ``None`` when there are no documents."""
        if self.cu_seqlens is None:
            return None
        if window not in self._masks:
            self._masks[window] = AttnMask(cu_seqlens=self.cu_seqlens, window=None if window is None else (window, 0))
        return self._masks[window]

    def __repr__(self) -> str:
        docs = 0 if self.cu_seqlens is None else self.cu_seqlens.numel() - 1
        return (f"ShardSpec(rows={self.plan.rows}, seq_len={self.seq_len}, documents={docs}, layout={self.layout!r}, "
                f"rank={self.rank}/{self.world_size})")


def _check_ids(name: str, x) -> Optional[str]:
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in (torch.int64, torch.int32):
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        return f"{name} must be an integer tensor [batch, seq], got {shape}"
    if x.shape[1] == 0 or x.shape[0] == 0:
        return f"{name} is empty (shape {tuple(x.shape)})"
    return None


def _resolve_layout(name: str, layout, given_group):
    """``(strategy spec, layout or None, group)`` from the registration of ``name`` and the call's own."""
    opts = registration(name)
    if opts is None:
        raise ValueError(f"shard_batch: attn_implementation {name!r} is not registered; call "
                         f"burstattn.hf.register({name!r}, ...) first (its strategy and layout decide the shards)")
    if layout is not None and opts.layout is not None and layout != opts.layout:
        raise ValueError(f"shard_batch: layout={layout!r} but {name!r} was registered with layout={opts.layout!r}; "
                         f"leave layout=None to use the registered one (or shard for another registration: name=...)")
    if given_group is not None and opts.group is not None and given_group is not opts.group:
        raise ValueError(f"shard_batch: group differs from the one {name!r} was registered with")
    return STRATEGIES[opts.strategy], layout if layout is not None else opts.layout, \
        given_group if given_group is not None else opts.group


def batch_signature(**tensors) -> tuple[tuple[str, str], ...]:
    """What every rank must hold alike: each named tensor's shape and the checksum of its values (as
    int64), ``"None"`` for one not given."""
    out = []
    for name, t in tensors.items():
        if t is None:
            out.append((name, "None"))
            continue
        t = torch.as_tensor(t).detach()
        out.append((name, f"{list(t.shape)}, crc32 {checksum(t.to(torch.int64)):08x}"))
    return tuple(out)


def checked_plan(fn: str, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None, *,
                 attention_mask=None, position_ids=None, cu_seq_lens_q=None, cu_seq_lens_k=None,
                 group: Optional[dist.ProcessGroup] = None) -> BatchPlan:
    """The unpadded :class:`BatchPlan` of a full batch that every rank of ``group`` must hold alike:
    ``ValueError`` (``fn`` first in its text) on every rank for bad input on any rank, or for batches
    that differ across ranks (one all-gather of checksums)."""
    problem = _check_ids("input_ids", input_ids)
    if problem is None and labels is not None:
        problem = _check_ids("labels", labels)
        if problem is None and labels.shape != input_ids.shape:
            problem = f"labels {tuple(labels.shape)} must match input_ids {tuple(input_ids.shape)}"
    if problem is None and position_ids is not None and (
            not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2
            or position_ids.shape[1] != input_ids.shape[1] or position_ids.shape[0] not in (1, input_ids.shape[0])):
        problem = (f"position_ids must be [batch or 1, {input_ids.shape[1]}], got "
                   f"{tuple(position_ids.shape) if isinstance(position_ids, torch.Tensor) else type(position_ids)}")
    plan = None
    if problem is None:
        plan, problem = plan_batch(input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                   cu_seq_lens_q=cu_seq_lens_q, cu_seq_lens_k=cu_seq_lens_k)
    sig = () if problem else batch_signature(input_ids=input_ids, labels=labels, attention_mask=attention_mask,
                                             position_ids=position_ids, cu_seq_lens_q=cu_seq_lens_q)
    agree(fn, sig, group_context(group).group, problem=problem,
          hint="every rank must pass the same full batch (shard_batch gives each rank its shard)")
    return plan


def place(plan: BatchPlan, layout, spec_s, world: int):
    """``(plan, layout)``: ``plan`` padded to what ``layout`` splits over ``world`` ranks; with
    ``layout=None``, a document-balanced partition for a flattened (packed or padded) plan when the
    strategy ``spec_s`` takes partitions, else its default layout."""
    if layout is None and plan.flattened and spec_s.partitions:
        plan = plan.padded(world)
        return plan, document_partition(plan.cu_seqlens(), world, causal=True)
    layout = layout_or_default(layout)
    return plan.padded(2 * world if layout == "zigzag" else world if isinstance(layout, str) else 1), layout


def shard_batch(input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None, *,
                attention_mask: Optional[torch.Tensor] = None, position_ids: Optional[torch.Tensor] = None,
                cu_seq_lens_q=None, cu_seq_lens_k=None, group: Optional[dist.ProcessGroup] = None,
                layout=None, name: str = "burst") -> dict:
    """This rank's model kwargs for the full batch ``input_ids [B, N]`` (the same on every rank).

    Args:
        labels: ``[B, N]`` (transformers' convention: shifted inside the loss; -100 ignored).
        attention_mask: 2-D padding mask ``[B, N]`` (left and/or right padding; rows of any lengths).
        position_ids: ``[B, N]`` or ``[1, N]``; restarts mark packed documents (``DataCollatorWithFlattening``).
        cu_seq_lens_q, cu_seq_lens_k: packed documents of a one-row batch, flash-attn's convention.
        group: the group of the attention (default: the one registered under ``name``).
        layout: ``None`` (default) takes the layout registered under ``name``; if that is ``None`` too,
            a document-balanced :class:`~burstattn.layouts.partition.Partition` for packed or padded batches (when
            the strategy takes partitions) and the strategy's default layout otherwise. Another layout
            than the registered one raises.
        name: the ``attn_implementation`` registered with :func:`burstattn.hf.register`.

    Returns ``input_ids [rows, n]`` (this rank's tokens), ``position_ids [rows, n]`` (their rotary
    positions), ``burst_shard`` (the :class:`ShardSpec`) and, with ``labels``, the labels shifted on the
    global sequence (``labels`` and ``shift_labels`` ``[rows, n]``; -100 past a row's end and at pads)
    and ``num_items_in_batch`` (a :class:`GlobalItemCount`). ``rows`` is ``B``, or 1 when packing or
    padding lays the rows end to end. A length the layout cannot split is padded at the end (token 0,
    label -100): no real token sees it. Raises ``ValueError`` on every rank for bad or differing input.
    """
    spec_s, layout, group = _resolve_layout(name, layout, group)
    group, rank, world = group_context(group)
    plan = checked_plan("shard_batch", input_ids, labels, attention_mask=attention_mask, position_ids=position_ids,
                        cu_seq_lens_q=cu_seq_lens_q, cu_seq_lens_k=cu_seq_lens_k, group=group)
    plan, layout = place(plan, layout, spec_s, world)
    pos = local_positions(plan.row_len, rank, world, layout).to(input_ids.device)
    ids = flatten_rows(input_ids, plan, 0)
    rope = rope_positions(position_ids, plan).to(input_ids.device)
    shard = ShardSpec(layout, plan, rank, world, pos.cpu(), name=name)
    batch = {"input_ids": ids[:, pos], "position_ids": rope[:, pos], SHARD_KEY: shard}
    if labels is not None:
        shifted = shifted_labels(labels, plan).to(labels.device)  # [rows, row_len]
        local = shifted[:, pos]
        batch.update(labels=local, shift_labels=local,
                     num_items_in_batch=GlobalItemCount(int((shifted != IGNORE_INDEX).sum()), group, world, shard))
    return batch


def shard_inputs(inputs: Mapping, *, group: Optional[dist.ProcessGroup] = None, layout=None,
                 name: str = "burst") -> dict:
    """:func:`shard_batch` for a collated batch dict (``input_ids``, ``labels``, ``attention_mask``,
    ``position_ids``, ``cu_seq_lens_q/k``, ``max_length_q/k``); any other key raises ``ValueError``
    (it could not be sharded consistently: never dropped)."""
    kw = batch_kwargs(inputs)
    return shard_batch(kw.pop("input_ids"), kw.pop("labels"), **kw, group=group, layout=layout, name=name)


def batch_kwargs(inputs: Mapping, fn: str = "shard_batch") -> dict:
    """:func:`shard_batch`'s arguments from a collated batch dict (``seq_idx`` becomes
    ``cu_seq_lens_q``); ``ValueError`` for a key that could not be sharded consistently (never dropped)."""
    unknown = sorted(k for k in inputs if k not in BATCH_KEYS)
    if unknown:
        raise ValueError(f"{fn}: cannot shard batch key(s) {unknown}; it takes {list(BATCH_KEYS)}")
    if "input_ids" not in inputs:
        raise ValueError(f"{fn}: the batch has no input_ids (inputs_embeds are not supported)")
    kw = {k: inputs.get(k) for k in ("input_ids", "labels", "attention_mask", "position_ids", "cu_seq_lens_q",
                                     "cu_seq_lens_k")}
    seq_idx = inputs.get("seq_idx")
    if seq_idx is not None and kw["cu_seq_lens_q"] is None:  # documents = runs of equal seq_idx
        row = torch.as_tensor(seq_idx).reshape(-1).to("cpu")
        if torch.as_tensor(seq_idx).dim() != 2 or torch.as_tensor(seq_idx).shape[0] != 1:
            raise ValueError(f"{fn}: seq_idx must be [1, seq] (one packed row), got {tuple(seq_idx.shape)}")
        change = torch.nonzero(row[1:] != row[:-1]).flatten() + 1
        kw["cu_seq_lens_q"] = torch.cat([torch.tensor([0]), change, torch.tensor([row.numel()])])
    return kw


def gather_logits(logits: torch.Tensor, group: Optional[dist.ProcessGroup] = None,
                  layout="zigzag", *, shard: Optional[ShardSpec] = None) -> torch.Tensor:
    """The full logits from every rank's ``[rows, n, V]`` (differentiable; see :func:`burstattn.gather_sequence`).

    With ``shard`` (the batch's ``burst_shard``): exactly the caller's ``[B, N, V]`` (rows restored, the
    layout's padding dropped). Without: ``[B, N_padded, V]`` in ``layout`` (slice ``[:, :N]``)."""
    if shard is None:
        return gather_sequence(logits, group=group, layout=layout, dim=1)
    shard.check_attended("the logits")
    full = gather_sequence(logits, group=group, layout=shard.layout, dim=1)  # [rows, row_len, V]
    plan = shard.plan
    if plan.flattened:
        return full[:, :plan.batch * plan.length].reshape(plan.batch, plan.length, *full.shape[2:])
    return full[:, :plan.length]


def sync_gradients(model: torch.nn.Module, group: Optional[dist.ProcessGroup] = None) -> None:
    """Sum every parameter's gradient over ``group`` (in place, one flat all-reduce per dtype).

    After ``model(**shard_batch(...)).loss.backward()`` on every rank, the gradients then equal the
    single-process gradients. A parameter without a gradient counts as zeros (and gets them).
    Raises ``ValueError`` (every rank alike, before any collective) for a model whose attention never
    reaches ``attn_implementation="burst"`` (:func:`~burstattn.hf.families.check_model`): its loss was
    computed from each rank's shard alone."""
    check_model(model.get_base_model() if hasattr(model, "get_base_model") else model)
    group, _, world = group_context(group)
    params = [p for p in model.parameters() if p.requires_grad]
    if world == 1:
        return
    for dtype in sorted({p.dtype for p in params}, key=str):
        same = [p for p in params if p.dtype == dtype]
        for p in same:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in same])
        dist.all_reduce(flat, group=group)
        at = 0
        for p in same:
            p.grad.copy_(flat[at:at + p.numel()].view_as(p.grad))
            at += p.numel()


__all__ = ["shard_batch", "shard_inputs", "gather_logits", "sync_gradients", "GlobalItemCount", "ShardSpec"]

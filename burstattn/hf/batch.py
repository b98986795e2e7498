"""Sequence-parallel batches for transformers models: shard, sum gradients, gather logits.

Every rank calls :func:`shard_batch` with the SAME full batch; it returns this rank's model kwargs.
``model(**batch).loss`` is then the single-process loss on every rank, and its backward gives this
rank's share of the gradients: :func:`sync_gradients` sums the shares.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..infer.sharded import rank_world
from ..layout import gather_sequence, local_positions

IGNORE_INDEX = -100  # transformers' ignore_index for the loss


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

    @staticmethod
    def __new__(cls, count: int, group: Optional[dist.ProcessGroup], world_size: int) -> "GlobalItemCount":
        obj = torch.Tensor._make_subclass(cls, torch.tensor(float(count)))
        obj.group, obj.world_size = group, world_size
        return obj

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        divides = func in (torch.Tensor.div, torch.Tensor.__truediv__, torch.div, torch.true_divide)
        if divides and len(args) == 2 and isinstance(args[1], cls) and not isinstance(args[0], cls):
            share, count = args
            total = share if count.world_size == 1 else _SumOverRanks.apply(share, count.group)
            return total / count.as_subclass(torch.Tensor).to(total.device)
        if func is torch.Tensor.to and isinstance(args[0], cls) and args[0].device == torch.device("cpu"):
            return args[0]
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def _check_ids(name: str, x) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in (torch.int64, torch.int32):
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"shard_batch: {name} must be an integer tensor [batch, seq], got {shape}")
    if x.shape[1] == 0:
        raise ValueError(f"shard_batch: {name} is empty (seq = 0)")


def shard_batch(input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None, *,
                group: Optional[dist.ProcessGroup] = None, layout: str = "zigzag") -> dict:
    """This rank's model kwargs for the full batch ``input_ids [B, N]`` (the same on every rank).

    Returns ``input_ids [B, n]`` (this rank's tokens in ``layout``), ``position_ids [B, n]`` (their
    GLOBAL positions) and, with ``labels [B, N]``, the labels shifted on the global sequence
    (``labels`` and ``shift_labels`` ``[B, n]``: the next token of each held token, -100 for the
    last) and ``num_items_in_batch`` (a :class:`GlobalItemCount`), so that ``model(**batch).loss``
    is the single-process loss.

    A length the layout cannot split is right-padded (``input_ids`` 0, labels -100) to the next
    multiple of ``2P`` (zigzag) or ``P``: under causal attention no real token sees a pad, so the
    loss and the real tokens' logits are unchanged; :func:`gather_logits` returns the padded length.
    ``layout`` must be the one given to :func:`burstattn.hf.register` (or that strategy's default).
    """
    _check_ids("input_ids", input_ids)
    _, rank, world = rank_world(group)
    b, n = input_ids.shape
    unit = 2 * world if layout == "zigzag" else world
    padded = -(-n // unit) * unit
    pad = padded - n
    pos = local_positions(padded, rank, world, layout).to(input_ids.device)
    ids = torch.cat([input_ids, input_ids.new_zeros(b, pad)], dim=1) if pad else input_ids
    batch = {"input_ids": ids[:, pos], "position_ids": pos.unsqueeze(0).expand(b, -1)}
    if labels is not None:
        _check_ids("labels", labels)
        if labels.shape != input_ids.shape:
            raise ValueError(f"shard_batch: labels {tuple(labels.shape)} must match input_ids {tuple(input_ids.shape)}")
        shifted = torch.cat([labels[:, 1:], labels.new_full((b, 1 + pad), IGNORE_INDEX)], dim=1)  # [B, padded]
        local = shifted[:, pos]
        batch.update(labels=local, shift_labels=local,
                     num_items_in_batch=GlobalItemCount(int((shifted != IGNORE_INDEX).sum()), group, world))
    return batch


def gather_logits(logits: torch.Tensor, group: Optional[dist.ProcessGroup] = None,
                  layout: str = "zigzag") -> torch.Tensor:
    """The full ``[B, N_padded, V]`` logits from every rank's ``[B, n, V]`` (differentiable; see
    :func:`burstattn.gather_sequence`). Slice ``[:, :N]`` if :func:`shard_batch` padded."""
    return gather_sequence(logits, group=group, layout=layout, dim=1)


def sync_gradients(model: torch.nn.Module, group: Optional[dist.ProcessGroup] = None) -> None:
    """Sum every parameter's gradient over ``group`` (in place, one flat all-reduce per dtype).

    After ``model(**shard_batch(...)).loss.backward()`` on every rank, the gradients then equal the
    single-process gradients. A parameter without a gradient counts as zeros (and gets them)."""
    group, _, world = rank_world(group)
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

"""The blockwise causal-LM loss for transformers models: from the last hidden states, in chunks.

transformers computes ``lm_head(hidden_states)`` for every position and then the loss, so a
rank holds ``[B, n, vocab]`` logits (and their float32 copy and gradient). :func:`causal_lm_loss`
runs the output projection and the cross-entropy over chunks of the sequence instead, each
recomputed in the backward (``torch.utils.checkpoint``), so at most one chunk's logits exist:
the same loss and gradients, a fraction of the memory at long context.

With the batch of :func:`burstattn.hf.shard_batch` (labels shifted on the global sequence,
``num_items_in_batch`` the global count) the result is the same global mean as
``model(**batch).loss`` on every rank, and its backward gives this rank's share of the gradients.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..config import IGNORE_INDEX
from ..models.fused_loss import fused_linear_cross_entropy



def _chunk_loss(head: Callable, h: torch.Tensor, labels: torch.Tensor, softcap: Optional[float]) -> torch.Tensor:
    logits = head(h).float()  # [B, c, V] in float32, as transformers' loss upcasts
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def _chunked_loss(head: Callable, hidden_states: torch.Tensor, labels: torch.Tensor, chunk_size: int,
                  softcap: Optional[float]) -> torch.Tensor:
    """The sum of the targets' cross-entropy over chunks of ``chunk_size`` rows, each recomputed."""
    n = hidden_states.shape[1]
    sizes = [min(chunk_size, n - a) for a in range(0, n, chunk_size)]
    total = None
    for h, lab in zip(hidden_states.split(sizes, dim=1), labels.split(sizes, dim=1)):
        if len(sizes) == 1:
            part = _chunk_loss(head, h, lab, softcap)
        else:
            part = checkpoint(_chunk_loss, head, h, lab, softcap, use_reentrant=False, preserve_rng_state=False)
        total = part if total is None else total + part
    return total


def causal_lm_loss(model: torch.nn.Module, hidden_states: torch.Tensor, labels: torch.Tensor,
                   num_items_in_batch=None, *, chunk_size: int = 1024,
                   head: Optional[Callable[[torch.Tensor], torch.Tensor]] = None, fused: bool = False) -> torch.Tensor:
    """The next-token cross-entropy of a causal LM from its last hidden states, chunk by chunk.

    Args:
        model: the ``*ForCausalLM`` model (its ``get_output_embeddings()`` is the head, and its
            config's ``final_logit_softcapping``, if any, is applied).
        hidden_states: ``[B, n, hidden]``, this rank's shard (``model.model(...).last_hidden_state``).
        labels: ``[B, n]`` int, already shifted (``shard_batch``'s ``shift_labels``: the next token
            of each held token, ``-100`` where there is none).
        num_items_in_batch: the divisor: ``shard_batch``'s :class:`~burstattn.hf.GlobalItemCount`
            (the global target count; dividing by it also sums the ranks' shares), a number, or
            ``None`` (this rank's own target count: a local mean).
        chunk_size: tokens of the sequence per chunk (a positive int).
        head: the output projection (default ``model.get_output_embeddings()``).
        fused: compute each chunk's gradients (with respect to the hidden states and the head's
            weight) in the forward and only scale them in the backward, instead of recomputing the
            chunk's projection there (:mod:`burstattn.models.fused_loss`; Liger-Kernel's fused linear
            cross-entropy). Keeps a float32 ``vocab x hidden`` weight gradient and the hidden states'
            gradient until the backward. The head must be a bias-free ``nn.Linear``.

    Returns:
        A float32 scalar: ``sum of the targets' cross-entropy / num_items_in_batch``.

    Raises:
        ValueError: ``chunk_size`` not a positive int, shapes that do not match, or ``fused`` with
            a head that is not a bias-free ``nn.Linear``.
    """
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"causal_lm_loss: chunk_size must be a positive int (tokens per chunk), got {chunk_size!r}")
    if hidden_states.dim() != 3 or tuple(labels.shape) != tuple(hidden_states.shape[:2]):
        raise ValueError(f"causal_lm_loss: hidden_states must be [B, n, hidden] and labels [B, n]; got "
                         f"{tuple(hidden_states.shape)} and {tuple(labels.shape)}")
    head = head if head is not None else model.get_output_embeddings()
    softcap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    if fused:
        if not isinstance(head, torch.nn.Linear) or head.bias is not None:
            raise ValueError(f"causal_lm_loss: fused=True needs the head to be a bias-free nn.Linear, got {head!r}")
        total = fused_linear_cross_entropy(hidden_states, head.weight, labels, chunk=chunk_size, softcap=softcap)
    else:
        total = _chunked_loss(head, hidden_states, labels, chunk_size, softcap)
    if num_items_in_batch is None:
        num_items_in_batch = (labels != IGNORE_INDEX).sum().clamp(min=1)
    return total / num_items_in_batch

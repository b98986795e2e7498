"""Blockwise computation along the local sequence: the MLP and the loss in chunks, recomputed.

RingAttention's *blockwise transformer* (and DeepSpeed ALST's TiledMLP and tiled loss): the
feed-forward and the loss are computed chunk by chunk along the sequence, each chunk under
``torch.utils.checkpoint``, so that at most one chunk's ``[chunk, ffn_dim]`` MLP intermediates
or ``[chunk, vocab]`` logits exist at a time, in the forward and in the backward. Every token's
result is the same as the whole sequence's (rows are independent); weight gradients are sums
over the chunks.

Rows under Megatron-V3 tensor parallelism: the residual stream of a tp rank holds ``m = n / tp``
rows of its context-parallel shard of ``n`` tokens, while the attention output and the logits
cover all ``n`` rows (gathered over tp, rank-major). Local chunk ``[a, b)`` then corresponds to
the rows ``t * m + [a, b)`` of every tp rank ``t`` of those tensors (:func:`row_chunks` for the
attention output, :func:`take_rows` for labels), which is also what the sequence-parallel
collectives of one chunk gather and scatter.

Shapes: hidden states ``[B, m, dim]``, attention outputs ``[B, shards * m, Hq, head_dim]``,
labels and answer masks ``[B, shards * m]``.
"""
from __future__ import annotations

import sys
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..config import IGNORE_INDEX

MLP_TILE = 2048
"""Automatic MLP chunk: ``max(MLP_TILE, dim)`` tokens (ALST tiles the MLP by about ``dim`` tokens)."""
LOSS_TILE_LOGITS = 1 << 24
"""Automatic loss chunk: about this many logits per chunk (64 MiB in float32), a power of two
between 256 and 8,192 tokens."""


def recomputed(fn: Callable, *args, context_fn: Optional[Callable] = None):
    """``fn(*args)`` under ``torch.utils.checkpoint`` (non-reentrant): its inputs are kept, the rest is
    rebuilt in the backward. The model draws no random numbers (no dropout), so the RNG state is
    not saved and restored (``preserve_rng_state=False``: 5 KB and a copy less per checkpoint)."""
    if context_fn is None:
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False, context_fn=context_fn)


def chunk_bounds(n: int, chunk: int) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` covering ``range(n)`` in pieces of ``chunk`` rows (the last one
    shorter when ``chunk`` does not divide ``n``); ``chunk == 0`` or ``chunk >= n``: one piece."""
    if chunk <= 0 or chunk >= n:
        return [(0, n)]
    return [(a, min(a + chunk, n)) for a in range(0, n, chunk)]


def take_rows(t: torch.Tensor, shards: int, m: int, start: int, stop: int) -> torch.Tensor:
    """The rows of ``t [B, shards * m, ...]`` that belong to local rows ``[start, stop)`` of each of
    the ``shards`` sequence shards: ``t[:, start:stop]`` when ``shards == 1`` (a view), else the
    rows ``s * m + [start, stop)`` for ``s = 0 .. shards-1`` in that order (a copy)."""
    if shards == 1:
        return t.narrow(1, start, stop - start)
    idx = (torch.arange(shards)[:, None] * m + torch.arange(start, stop)[None, :]).flatten()
    return t.index_select(1, idx.to(t.device))


def auto_chunks(dim: int, vocab_size: int, local_tokens: int) -> tuple[int, int]:
    """``(mlp_chunk, loss_chunk)`` for a local sequence of ``local_tokens`` rows when none was
    given: the MLP whole (0) up to twice its tile of ``max(MLP_TILE, dim)`` tokens, then that tile;
    the loss whole up to twice :data:`LOSS_TILE_LOGITS` logits, then the power of two of tokens
    (256 to 8,192) nearest below that many logits."""
    mlp_tile = max(MLP_TILE, dim)
    loss_tile = min(8192, max(256, 1 << max(0, (LOSS_TILE_LOGITS // max(vocab_size, 1)).bit_length() - 1)))
    mlp = 0 if local_tokens <= 2 * mlp_tile else mlp_tile
    loss = 0 if local_tokens * vocab_size <= 2 * LOSS_TILE_LOGITS else loss_tile
    return mlp, loss


def row_chunks(t: torch.Tensor, shards: int, chunk: int) -> tuple[torch.Tensor, ...]:
    """``t [B, shards * m, ...]`` cut into the row chunks of :func:`chunk_bounds` ``(m, chunk)``, each
    ``[B, shards, c, ...]``: chunk j holds the rows ``s * m + [a_j, b_j)`` of every shard ``s``. One
    ``split`` (views): its backward concatenates the chunks' gradients once, where a ``narrow``
    per chunk would make a zero-filled whole-size gradient per chunk."""
    b, rows = t.shape[0], t.shape[1]
    m = rows // shards
    sizes = [stop - start for start, stop in chunk_bounds(m, chunk)]
    return t.view(b, shards, m, *t.shape[2:]).split(sizes, dim=2)


def merge_shards(piece: torch.Tensor) -> torch.Tensor:
    """``[B, shards, c, ...]`` -> ``[B, shards * c, ...]`` (a view for one shard, else a copy)."""
    return piece.reshape(piece.shape[0], piece.shape[1] * piece.shape[2], *piece.shape[3:])


def blockwise_rows(fn: Callable, x: torch.Tensor, extra: torch.Tensor, *, chunk: int, recompute: bool,
                   shards: int = 1) -> torch.Tensor:
    """``cat_j fn(x_j, extra_j)`` over the row chunks of ``x [B, m, ...]`` and the matching chunks of
    ``extra [B, shards * m, ...]`` (:func:`row_chunks`: ``extra_j [B, shards, c, ...]``), each under
    :func:`recomputed` when ``recompute`` (its inputs, views, are kept; its intermediates rebuilt in
    the backward)."""
    xs = x.split([b - a for a, b in chunk_bounds(x.shape[1], chunk)], dim=1)
    extras = row_chunks(extra, shards, chunk)
    outs = [recomputed(fn, xc, ec) if recompute else fn(xc, ec) for xc, ec in zip(xs, extras)]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def _chunk_ce(head: Callable, h: torch.Tensor, labels: torch.Tensor,
              answer: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``head(h)`` -> logits ``[B, c, V]`` (computed in at least float32) -> ``(sum of the targets'
    cross-entropy, [answer hits, answer cross-entropy sum])`` (the second detached, float64)."""
    logits = head(h)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
    with torch.no_grad():
        if answer is None:
            stats = torch.zeros(2, dtype=torch.float64, device=ce.device)
        else:
            hit = (logits.argmax(-1) == labels) & answer
            stats = torch.stack([hit.sum().double(), (ce.detach().double() * answer.flatten()).sum()])
    return ce.sum(), stats


def blockwise_cross_entropy(head: Callable, hidden: torch.Tensor, labels: torch.Tensor, *, chunk: int,
                            answer: Optional[torch.Tensor] = None, shards: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of the next-token cross-entropy over the targets of ``labels [B, shards*m]`` (``IGNORE_INDEX``:
    no target) for ``hidden [B, m, dim]``, ``head(h [B, c, dim]) -> logits [B, shards*c, V]`` (the
    final norm and output projection), over chunks of ``chunk`` rows (0: all at once, nothing
    recomputed). Returns ``(ce_sum, stats)``: ``ce_sum`` a differentiable float32 scalar;
    ``stats`` float64 ``[hits, ce_sum]`` over the ``answer [B, shards*m]`` positions (zeros when
    ``answer`` is None), detached.
    """
    m = hidden.shape[1]
    total, stats = None, None
    pieces = hidden.split([b - a for a, b in chunk_bounds(m, chunk)], dim=1)  # one split: see row_chunks
    for (a, b), hc in zip(chunk_bounds(m, chunk), pieces):
        lab = take_rows(labels, shards, m, a, b)
        ans = None if answer is None else take_rows(answer, shards, m, a, b)
        if chunk > 0:
            ce, st = recomputed(_chunk_ce, head, hc, lab, ans)
        else:
            ce, st = _chunk_ce(head, hc, lab, ans)
        total = ce if total is None else total + ce
        stats = st if stats is None else stats + st
    return total, stats


def __getattr__(name: str):
    # names that moved out of this module (the table burstattn.MOVED): resolved, or refused with the new spelling
    return sys.modules["burstattn"].moved_attribute(__name__, name)

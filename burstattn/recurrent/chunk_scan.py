"""A scan over blocks of tokens that keeps only the block-boundary states for its backward.

The chunked recurrences (:mod:`.chunked`) build, per chunk of ``C`` tokens and head, ``[C, C]``
decay-masked products, UT-transformed values and chunk states; autograd would keep all of them
(about 20 KB per token and head for the delta rule with its identity columns) until the backward.
:func:`block_scan` runs the same chunked form one block of a few chunks at a time, without a graph,
keeping only its inputs and the carried state at every block start (as flash-linear-attention's
kernels keep the chunk-boundary states). The backward walks the blocks in reverse: it reruns one
block from its saved start state with the graph on (the intra-block products in the forward's
order) and back-propagates the block's output gradient and the state gradient from the block
after it, so only one block's graph is alive at a time. The arithmetic of every block is the
forward's, so the gradients are those of the plain chunked form (float64: to rounding).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

BLOCK_CHUNKS = 4
"""Chunks per block of :func:`block_scan` as the sequence-parallel ops call it."""


def block_scan(fn: Callable, carry: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], *, block: int
               ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Run ``fn`` over consecutive blocks of ``block`` tokens, threading a carried state.

    Args:
        fn: ``fn(carry, *inputs_block) -> (outputs, new_carry)``: one block's chunked recurrence;
            ``inputs_block`` are ``inputs`` sliced to the block's tokens along dim 1, ``outputs`` a
            tuple of ``[b, l, ...]`` tensors (l the block's tokens), ``new_carry`` like ``carry``.
        carry: the state before the first token (tuple of tensors, e.g. ``S [b, H, dk, dv]``).
        inputs: per-token tensors ``[b, L, ...]`` (one ``L`` for all).
        block: tokens per block (a multiple of the chunk size keeps the chunks of the plain form).
    Returns:
        ``(outputs concatenated along dim 1, the carry after the last token)``. Differentiable in
        ``carry`` and ``inputs``; the backward recomputes block by block (no double backward).
    Raises:
        ValueError: ``block`` not a positive int, or inputs of different lengths.
    """
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block_scan: block must be a positive int, got {block!r}")
    L = inputs[0].shape[1]
    if any(x.shape[1] != L for x in inputs):
        raise ValueError(f"block_scan: inputs must share their length, got {[tuple(x.shape) for x in inputs]}")
    out = _BlockScan.apply(fn, block, len(carry), *carry, *inputs)
    n_out = len(out) - len(carry)
    return tuple(out[:n_out]), tuple(out[n_out:])


def _bounds(L: int, block: int) -> list[tuple[int, int]]:
    return [(a, min(a + block, L)) for a in range(0, L, block)]


class _BlockScan(torch.autograd.Function):
    """Forward without a graph, saving the inputs and the carry at every block start; backward
    reruns each block with the graph on, last block first."""

    @staticmethod
    def forward(ctx, fn, block, n_carry, *tensors):
        carry, inputs = tuple(tensors[:n_carry]), tuple(tensors[n_carry:])
        starts, outs = [], []
        with torch.no_grad():
            for a, b in _bounds(inputs[0].shape[1], block):
                starts.append(carry)
                o, carry = fn(carry, *(x[:, a:b] for x in inputs))
                outs.append(tuple(o))
        outputs = tuple(torch.cat(parts, dim=1) if len(parts) > 1 else parts[0] for parts in zip(*outs))
        ctx.fn, ctx.block, ctx.n_carry, ctx.n_out = fn, block, n_carry, len(outputs)
        ctx.save_for_backward(*inputs, *(t for c in starts for t in c))
        ctx.n_inputs = len(inputs)
        return (*outputs, *carry)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        saved = ctx.saved_tensors
        inputs, flat = saved[:ctx.n_inputs], saved[ctx.n_inputs:]
        nc, n_out = ctx.n_carry, ctx.n_out
        bounds = _bounds(inputs[0].shape[1], ctx.block)
        starts = [flat[i * nc:(i + 1) * nc] for i in range(len(bounds))]
        g_out, g_carry = grads[:n_out], list(grads[n_out:])
        want_in = ctx.needs_input_grad[3 + nc:]
        want_carry = ctx.needs_input_grad[3:3 + nc]
        g_in = [torch.empty_like(x) if w else None for x, w in zip(inputs, want_in)]  # filled block by block
        for (a, b), start in zip(reversed(bounds), reversed(starts)):
            c0 = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in start)
            xs = tuple(x[:, a:b].detach().requires_grad_(w) for x, w in zip(inputs, want_in))
            with torch.enable_grad():
                o, c1 = ctx.fn(c0, *xs)
            pairs = [(t, g[:, a:b]) for t, g in zip(o, g_out) if g is not None and t.requires_grad]
            pairs += [(t, g) for t, g in zip(c1, g_carry) if g is not None and t.requires_grad]
            leaves = [x for x, w in zip(xs, want_in) if w] + [c for c in c0 if c.requires_grad]
            got = torch.autograd.grad([t for t, _ in pairs], leaves, [g for _, g in pairs], allow_unused=True) \
                if pairs and leaves else [None] * len(leaves)
            got = list(got)
            for i, w in enumerate(want_in):
                if w:
                    gi = got.pop(0)
                    g_in[i][:, a:b] = 0 if gi is None else gi
            g_carry = [None if not c.requires_grad else got.pop(0) for c in c0]
        g_c = [g if w else None for g, w in zip(g_carry, want_carry)]
        return (None, None, None, *g_c, *g_in)

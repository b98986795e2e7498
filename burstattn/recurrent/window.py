"""The short causal convolution's local product, keeping only its input table for the backward.

``y = act(sum_j w[:, j] table[index[:, j]] + bias)``: autograd would keep the ``[B, n, K, C]`` window
(``K`` copies of every input) and the pre-activation; :func:`window_conv` keeps the table
``[B, rows, C]`` (the inputs, the halo and a zero row) and recomputes the rest in the backward.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..config import accum_dtype

ROWS = 512
"""Tokens per block of the backward."""


def window_conv(table: torch.Tensor, index: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                silu: bool) -> torch.Tensor:
    """Depthwise causal convolution from a row table.

    Args:
        table: ``[B, rows, C]``: the rows every window reads.
        index: ``[n, K]`` int64 rows of ``table`` (tap ``j`` of token ``t``; K the width).
        weight: ``[C, K]``; bias: ``[C]`` or ``None``; silu: apply ``silu`` after the bias.
    Returns:
        ``[B, n, C]`` in the table's dtype. The taps' sum, the bias and the activation are formed in
        :func:`~burstattn.config.accum_dtype` (float32 for 16-bit tables), rounded once at the end.
    """
    return _WindowConv.apply(table, index, weight, bias, silu)


def _pre(table, index, weight, bias):
    """The pre-activation ``[B, n, C]`` in ``weight``'s dtype (the accumulator's), ``ROWS`` tokens and one
    tap at a time (no ``[B, n, K, C]`` window)."""
    y = table.new_empty(table.shape[0], index.shape[0], table.shape[2], dtype=weight.dtype)
    for a in range(0, index.shape[0], ROWS):
        idx, part = index[a:a + ROWS], y[:, a:a + ROWS]
        torch.mul(table[:, idx[:, 0]].to(weight.dtype), weight[:, 0], out=part)
        for j in range(1, idx.shape[1]):
            part.addcmul_(table[:, idx[:, j]].to(weight.dtype), weight[:, j])
    return y if bias is None else y.add_(bias)


class _WindowConv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, table, index, weight, bias, silu):
        up = accum_dtype(table.dtype)
        ctx.silu, ctx.dtypes = silu, (weight.dtype, None if bias is None else bias.dtype)
        weight, bias = weight.to(up), None if bias is None else bias.to(up)
        ctx.save_for_backward(table, index, weight, *(() if bias is None else (bias,)))
        y = _pre(table, index, weight, bias)
        return (F.silu(y) if silu else y).to(table.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        table, index, weight, *rest = ctx.saved_tensors
        bias = rest[0] if rest else None
        up = weight.dtype
        d_table = torch.zeros_like(table, dtype=up) if ctx.needs_input_grad[0] else None
        d_weight = torch.zeros_like(weight) if ctx.needs_input_grad[2] else None
        d_bias = torch.zeros_like(bias) if bias is not None and ctx.needs_input_grad[3] else None
        for a in range(0, index.shape[0], ROWS):  # a block of tokens at a time: small transients
            idx, g = index[a:a + ROWS], grad[:, a:a + ROWS].to(up)
            if ctx.silu:  # d silu(y) = sigmoid(y) (1 + y (1 - sigmoid(y)))
                y = _pre(table, idx, weight, bias)
                sig = torch.sigmoid(y)
                g = g * sig * y.mul_(1 - sig).add_(1)
            for j in range(idx.shape[1]):
                if d_weight is not None:
                    d_weight[:, j] += (g * table[:, idx[:, j]].to(up)).sum((0, 1))
                if d_table is not None:
                    d_table.index_add_(1, idx[:, j], g * weight[:, j])
            if d_bias is not None:
                d_bias += g.sum((0, 1))
        return (None if d_table is None else d_table.to(table.dtype), None,
                None if d_weight is None else d_weight.to(ctx.dtypes[0]),
                None if d_bias is None else d_bias.to(ctx.dtypes[1]), None)

"""The short causal convolution's local product, keeping only its input table for the backward.

``y = act(sum_j w[:, j] table[index[:, j]] + bias)``: autograd would keep the ``[B, n, K, C]`` window
(``K`` copies of every input) and the pre-activation; :func:`window_conv` keeps the table
``[B, rows, C]`` (the inputs, the halo and a zero row) and recomputes the rest in the backward.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def window_conv(table: torch.Tensor, index: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                silu: bool) -> torch.Tensor:
    """Depthwise causal convolution from a row table.

    Args:
        table: ``[B, rows, C]``: the rows every window reads.
        index: ``[n, K]`` int64 rows of ``table`` (tap ``j`` of token ``t``; K the width).
        weight: ``[C, K]``; bias: ``[C]`` or ``None``; silu: apply ``silu`` after the bias.
    Returns:
        ``[B, n, C]`` in the table's dtype.
    """
    return _WindowConv.apply(table, index, weight.to(table.dtype), None if bias is None else bias.to(table.dtype),
                             silu)


def _conv(table, index, weight, bias, silu):
    y = torch.einsum("bnkc,ck->bnc", table[:, index], weight)  # [B, n, C]
    if bias is not None:
        y = y + bias
    return F.silu(y) if silu else y


class _WindowConv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, table, index, weight, bias, silu):
        ctx.silu, ctx.has_bias = silu, bias is not None
        ctx.save_for_backward(table, index, weight, *(() if bias is None else (bias,)))
        return _conv(table, index, weight, bias, silu)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        table, index, weight, *rest = ctx.saved_tensors
        bias = rest[0] if rest else None
        leaves = [t.detach().requires_grad_(w) for t, w in
                  ((table, ctx.needs_input_grad[0]), (weight, ctx.needs_input_grad[2]))]
        b = None if bias is None else bias.detach().requires_grad_(ctx.needs_input_grad[3])
        want = [t for t in (*leaves, b) if t is not None and t.requires_grad]
        if not want:
            return None, None, None, None, None
        with torch.enable_grad():
            y = _conv(leaves[0], index, leaves[1], b, ctx.silu)
        got = list(torch.autograd.grad(y, want, grad))
        out = [got.pop(0) if t is not None and t.requires_grad else None for t in (*leaves, b)]
        return out[0], None, out[1], out[2], None

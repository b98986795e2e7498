"""RMSNorm (LLaMA): computed in (at least) float32, cast back to the input dtype.

The backward keeps only the input and the per-row ``rsqrt`` (:class:`_RMSNormFunction`): the
float32 normalised values are rebuilt from them, so a norm holds no float32 copy of its row
between forward and backward (a DTensor input, under sequence parallelism, takes the plain
autograd path instead).
"""
from __future__ import annotations

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from ..kernels.base import chunk_rows


def plain(t) -> bool:
    """Whether ``t`` is a plain tensor (or parameter) for the fused autograd nodes: a ``torch.Tensor``,
    or a fake one (``burstattn train --dry-run``: the fake tensor stands for a plain device tensor, so
    it takes the path the real run takes), not a DTensor or another subclass."""
    return type(t) in (torch.Tensor, nn.Parameter) or isinstance(t, FakeTensor)


def _normalise(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x in at least float32 * rstd, rstd [..., 1])``."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf * rstd, rstd


class _RMSNormFunction(torch.autograd.Function):
    """``y = (x * rstd * w)`` in float32, cast to x's dtype; saves ``x``, ``w`` and ``rstd`` only.

    Rows are normalised :func:`~burstattn.kernels.base.chunk_rows` at a time (32 MiB of float32 per
    temporary), forward and backward: the float32 temporaries of a norm over a long shard (at a million
    tokens on one GPU, several float32 ``[N, dim]`` tensors: the step's largest buffers) stay one chunk's.
    One chunk (the usual case) runs the whole rows at once."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        d = x.shape[-1]
        rows = x.reshape(-1, d)
        step = chunk_rows(d)
        if rows.shape[0] <= step:
            normed, rstd = _normalise(x, eps)
            ctx.save_for_backward(x, weight, rstd)
            return (normed * weight.to(normed.dtype)).to(x.dtype)
        acc = torch.promote_types(x.dtype, torch.float32)
        out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
        rstd = torch.empty(rows.shape[0], 1, dtype=acc, device=x.device)
        w = weight.to(acc)
        for i in range(0, rows.shape[0], step):
            normed, r = _normalise(rows[i:i + step], eps)
            out[i:i + step] = normed * w  # cast to x's dtype by the copy, as .to() does
            rstd[i:i + step] = r
        ctx.save_for_backward(x, weight, rstd.view(*x.shape[:-1], 1))
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        d = x.shape[-1]
        step = chunk_rows(d)
        if x.numel() // max(d, 1) <= step:
            gx, gw = _norm_backward(x, grad, weight, rstd)
            return gx.to(x.dtype), gw.reshape(-1, d).sum(0).to(weight.dtype), None
        rows, grads, rs = x.reshape(-1, d), grad.reshape(-1, d), rstd.reshape(-1, 1)
        grad_x = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
        grad_w = torch.zeros(d, dtype=rstd.dtype, device=x.device)
        for i in range(0, rows.shape[0], step):
            gx, gw = _norm_backward(rows[i:i + step], grads[i:i + step], weight, rs[i:i + step])
            grad_x[i:i + step] = gx
            grad_w += gw.sum(0)
        return grad_x.view(x.shape), grad_w.to(weight.dtype), None


def _norm_backward(x: torch.Tensor, grad: torch.Tensor, weight: torch.Tensor,
                   rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, g * normed)`` in ``rstd``'s dtype for rows ``x [..., dim]``, their output gradient and ``rstd [..., 1]``
    (the weight's gradient is the second summed over the rows)."""
    normed = x.to(rstd.dtype) * rstd
    g = grad.to(rstd.dtype)
    gn = g * weight.to(rstd.dtype)
    return rstd * (gn - normed * (gn * normed).mean(-1, keepdim=True)), g * normed


class RMSNorm(nn.Module):
    """``x * rsqrt(mean(x^2, -1) + eps) * weight``; ``x [..., dim]`` -> same shape and dtype."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if plain(x) and plain(self.weight):
            return _RMSNormFunction.apply(x, self.weight, self.eps)
        normed, _ = _normalise(x, self.eps)  # DTensors (sequence parallelism): plain autograd
        return (normed * self.weight.to(normed.dtype)).to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"

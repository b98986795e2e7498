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
    """``y = (x * rstd * w)`` in float32, cast to x's dtype; saves ``x``, ``w`` and ``rstd`` only."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        normed, rstd = _normalise(x, eps)
        ctx.save_for_backward(x, weight, rstd)
        return (normed * weight.to(normed.dtype)).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        xf = x.to(rstd.dtype)
        normed = xf * rstd
        g = grad.to(rstd.dtype)
        grad_w = (g * normed).reshape(-1, normed.shape[-1]).sum(0).to(weight.dtype)
        gn = g * weight.to(rstd.dtype)
        grad_x = rstd * (gn - normed * (gn * normed).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_w, None


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

"""RMSNorm (LLaMA): computed in (at least) float32, cast back to the input dtype."""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``x * rsqrt(mean(x^2, -1) + eps) * weight``; ``x [..., dim]`` -> same shape and dtype."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))  # at least float32
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.to(xf.dtype)).to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"

"""Rotary position embeddings in the rotate-half (HF / GPT-NeoX) convention, from GLOBAL positions.

A sequence shard passes the global positions it holds (``burstattn.sequence_positions``), so a
sharded model rotates every token exactly as the unsharded model would. The backward rebuilds the
cos/sin tables from the positions (:class:`_RotaryFunction`) instead of keeping them.
"""
from __future__ import annotations

import torch

from ..kernels.base import chunk_rows
from .norms import plain


def rotary_angles(positions: torch.Tensor, head_dim: int, theta: float) -> torch.Tensor:
    """``emb [n, head_dim]`` float32: ``cat(angles, angles)`` with
    ``angles = positions[:, None] * theta ** (-arange(0, head_dim, 2) / head_dim)``."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None]  # [n, head_dim / 2]
    return torch.cat([angles, angles], dim=-1)  # [n, head_dim]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``cat(-x2, x1)`` over the last dimension (``x = cat(x1, x2)``)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate ``x [B, n, H, head_dim]`` by the angles of ``positions [n]`` (int64, global token
    positions): ``x * cos(emb) + rotate_half(x) * sin(emb)``, computed in (at least) float32, returned in x's
    dtype and shape.

    Raises:
        ValueError: ``positions`` is not 1-D of length ``n``, or ``head_dim`` is odd.
    """
    if x.dim() != 4 or positions.dim() != 1 or positions.shape[0] != x.shape[1]:
        raise ValueError(f"apply_rotary: x must be [B, n, H, head_dim] and positions [n]; got x {tuple(x.shape)}, "
                         f"positions {tuple(positions.shape)}")
    if x.shape[-1] % 2:
        raise ValueError(f"apply_rotary: head_dim must be even, got {x.shape[-1]}")
    if plain(x):
        return _RotaryFunction.apply(x, positions, theta)
    return _rotate(x, positions, theta, sign=1.0)


def _rotate(x: torch.Tensor, positions: torch.Tensor, theta: float, sign: float) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` (``sign=-1``: the transpose, ``x * cos - rotate_half(x * sin)``)."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))  # at least float32 (float64 stays float64)
    emb = rotary_angles(positions, x.shape[-1], theta).to(xf.dtype)[None, :, None, :]  # [1, n, 1, head_dim]
    if sign > 0:
        return (xf * emb.cos() + rotate_half(xf) * emb.sin()).to(x.dtype)
    return (xf * emb.cos() - rotate_half(xf * emb.sin())).to(x.dtype)


def _rotate_chunks(x: torch.Tensor, positions: torch.Tensor, theta: float, sign: float) -> torch.Tensor:
    """:func:`_rotate` of ``x [B, n, H, head_dim]`` over :func:`~burstattn.kernels.base.chunk_rows` positions
    at a time (32 MiB of float32 per temporary), into one output in x's dtype: the same values (the rotation
    is elementwise per position), but the float32 temporaries of a long shard (at half a million tokens on
    one GPU, four float32 copies of q: the backward's largest buffers) stay one chunk's. One chunk (the
    usual case) runs the whole shard at once."""
    n = x.shape[1]
    step = chunk_rows(x[:, :1].numel())
    if n <= step:
        return _rotate(x, positions, theta, sign)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    for i in range(0, n, step):
        out[:, i:i + step] = _rotate(x[:, i:i + step], positions[i:i + step], theta, sign)
    return out


class _RotaryFunction(torch.autograd.Function):
    """The rotation as one autograd node that saves only the positions (cos/sin rebuilt backward),
    positions in chunks (:func:`_rotate_chunks`), forward and backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
        ctx.save_for_backward(positions)
        ctx.theta = theta
        return _rotate_chunks(x, positions, theta, sign=1.0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (positions,) = ctx.saved_tensors
        return _rotate_chunks(grad, positions, ctx.theta, sign=-1.0), None, None

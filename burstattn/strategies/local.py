"""Differentiable single-device attention through the kernel seam (for strategies that
gather a full sequence or full heads onto one rank: ulysses, tp, allgather)."""
from __future__ import annotations

from typing import Optional

import torch

from ..autograd import refuse_double_backward, without_autocast
from ..kernels import get_kernel, resolve_backend


class _LocalAttn(torch.autograd.Function):
    @staticmethod
    @without_autocast
    def forward(ctx, q, k, v, scale: float, causal: bool, backend: str):
        kernel = get_kernel(backend)
        qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))  # [B, S, H, D] -> [B, H, S, D]
        out, lse = kernel.forward(qh, kh, vh, scale, causal)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.causal, ctx.backend = scale, causal, backend
        return out.transpose(1, 2)

    @staticmethod
    @without_autocast
    def backward(ctx, dout):
        refuse_double_backward()
        q, k, v, out, lse = ctx.saved_tensors
        kernel = get_kernel(ctx.backend)
        dq, dk, dv = kernel.backward(dout.transpose(1, 2).to(q.dtype), q.transpose(1, 2), k.transpose(1, 2),
                                     v.transpose(1, 2), out, lse, ctx.scale, ctx.causal)
        return (dq.transpose(1, 2).to(q.dtype), dk.transpose(1, 2).to(k.dtype),
                dv.transpose(1, 2).to(v.dtype), None, None, None)


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                    softmax_scale: Optional[float] = None, backend: str = "auto") -> torch.Tensor:
    """Attention of ``q [B, Sq, Hq, D]`` over ``k, v [B, Sk, Hkv, D]`` on this device.

    ``causal`` requires ``Sq == Sk`` (key j visible to query i iff j <= i). Returns
    ``[B, Sq, Hq, D]`` in q's dtype. Differentiable.
    """
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(f"causal local attention needs equal query and key lengths, got {q.shape[1]} "
                         f"and {k.shape[1]}")
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    name = resolve_backend(backend, q.device, q.dtype)
    return _LocalAttn.apply(q, k, v, float(scale), bool(causal), name)


def masked_local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg) -> torch.Tensor:
    """Attention of the whole sequence in global order on this device under ``cfg.mask``
    (``q [B, N, Hq, D]``, ``k, v [B, N, Hkv, D]`` -> ``[B, N, Hq, D]``): the masked engine at a
    world of one, computing only the non-empty block ops. Differentiable."""
    from dataclasses import replace

    from ..autograd import BurstAttnFunction, GroupContext
    from ..masks.plan import mask_plan

    n = q.shape[1]
    plan = mask_plan(cfg.mask, cfg.causal, n, 1, "contiguous", 0)
    local = replace(cfg, layout="contiguous", backend=resolve_backend(cfg.backend, q.device, q.dtype),
                    backward="burst")
    return BurstAttnFunction.apply(q, k, v, None, None, GroupContext(None, 0, 1), local, plan)[0]

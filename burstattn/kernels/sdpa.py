"""PyTorch's own CUDA SDPA kernels that return the LSE (flash for 16-bit, memory-efficient for float32)."""
from __future__ import annotations

import math

import torch

from .base import expand_kv, reduce_kv_grad


def sdpa_cuda_available() -> bool:
    """Whether CUDA and the SDPA flash / memory-efficient ops are present."""
    return torch.cuda.is_available() and hasattr(torch.ops.aten, "_scaled_dot_product_efficient_attention")


def _use_flash(q: torch.Tensor) -> bool:
    return q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256 and q.shape[-1] % 8 == 0


class SdpaKernel:
    """CUDA SDPA: ``_scaled_dot_product_flash_attention`` for fp16/bf16, else the
    memory-efficient kernel. K/V are expanded for GQA inside the call (not on the wire)."""

    name = "sdpa"

    def forward(self, q, k, v, scale, causal):
        hq = q.shape[1]
        k, v = expand_kv(k, hq), expand_kv(v, hq)
        sq = q.shape[-2]
        if _use_flash(q):
            res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
            return res[0], res[1][..., :sq]
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, causal, scale=scale)
        return out, lse[..., :sq]

    def backward(self, dout, q, k, v, out, lse, scale, causal):
        hq, hkv = q.shape[1], k.shape[1]
        k, v = expand_kv(k, hq), expand_kv(v, hq)
        sq, sk = q.shape[-2], k.shape[-2]
        dout, out, lse = dout.contiguous(), out.contiguous(), lse.contiguous()
        empty = torch.empty(0, device=q.device)
        if _use_flash(q):
            seed = torch.zeros((), dtype=torch.int64, device=q.device)
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                dout, q, k, v, out, lse, empty, empty, sq, sk, 0.0, causal, seed, seed, scale=scale)
        else:
            padded = math.ceil(sq / 32) * 32
            lse_p = lse.new_zeros(*lse.shape[:-1], padded)
            lse_p[..., :sq] = lse
            seed = torch.zeros((), dtype=torch.int64, device=q.device)
            dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
                dout, q, k, v, None, out, lse_p, seed, seed, 0.0, [True, True, True, False],
                causal, scale=scale)
        return dq, reduce_kv_grad(dk, hkv), reduce_kv_grad(dv, hkv)

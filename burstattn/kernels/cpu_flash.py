"""PyTorch's fused CPU flash-attention op (``aten::_scaled_dot_product_flash_attention_for_cpu``)."""
from __future__ import annotations

import torch

from .base import expand_kv, mask_bias, pad_head_dims, reduce_kv_grad


def cpu_flash_available() -> bool:
    """Whether this PyTorch build has the CPU flash op and its backward."""
    return (hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")
            and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward"))


def _native_gqa() -> bool:
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 5)


class CpuFlashKernel:
    """Fused flash attention on CPU (float32, bfloat16, float16) returning the LSE. No score
    modifiers; a V head size of its own by zero-padding the block to one head size."""

    name = "cpu_flash"
    # masks as an additive bias of q's dtype (the op rejects bool masks)
    supports = frozenset({"mask", "v_head_dim"})
    supports_mask = True
    fp32_grads = False
    float32 = True

    def __init__(self) -> None:
        self.native_gqa = _native_gqa()

    def _kv(self, q, k, v):
        if self.native_gqa:
            return k, v
        return expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])

    def forward(self, q, k, v, scale, causal, mask=None, mods=None):
        dv = v.shape[-1]
        q, k, v = pad_head_dims(q, k, v)
        k, v = self._kv(q, k, v)
        bias = None if mask is None else mask_bias(mask, q.dtype)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=bias, scale=scale)
        return _cols(out, dv), lse

    def backward(self, dout, q, k, v, out, lse, scale, causal, mask=None, mods=None):
        hkv, d, dv = k.shape[1], q.shape[-1], v.shape[-1]
        q, k, v = pad_head_dims(q, k, v)
        if dv < d:  # the padded value columns have output 0 and no gradient
            dout, out = (torch.nn.functional.pad(x, (0, d - dv)) for x in (dout, out))
        k, v = self._kv(q, k, v)
        bias = None if mask is None else mask_bias(mask, q.dtype)
        dq, dk, dv_ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale)
        return _cols(dq, d), _cols(reduce_kv_grad(dk, hkv), d), _cols(reduce_kv_grad(dv_, hkv), dv)


def _cols(x: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` head columns of ``x [..., D]`` (``x`` itself when unpadded: no view op per call)."""
    return x if x.shape[-1] == n else x[..., :n]

"""PyTorch's own CUDA SDPA kernels that return the LSE.

For float16/bfloat16: cuDNN attention where this PyTorch has it (on Hopper it runs about
twice as fast as the flash kernel: 13.1 ms vs 24.5 ms fwd+bwd, N=16384, 16 heads, d=128,
bf16, H200), else the flash kernel; for float32 the memory-efficient kernel.
Grouped K/V heads (GQA) go to the flash kernel as they are (it takes them natively, as cuDNN's does from
PyTorch 2.8); the memory-efficient kernel gets them expanded to the query heads (never on the wire).
What each kernel allocates beside its inputs and outputs: :mod:`.workspace`.
"""
from __future__ import annotations

import math

import torch

from .base import expand_kv, mask_bias, pad_head_dims, reduce_kv_grad


def sdpa_cuda_available() -> bool:
    """Whether CUDA and the SDPA flash / memory-efficient ops are present."""
    return torch.cuda.is_available() and hasattr(torch.ops.aten, "_scaled_dot_product_efficient_attention")


def _torch_at_least(major: int, minor: int) -> bool:
    return tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (major, minor)


def native_gqa(impl: str) -> bool:
    """Whether kernel ``impl`` takes fewer K/V heads than query heads as they are: flash (flash-attn 2's
    own GQA; its backward sums the expanded dK/dV itself), cuDNN from PyTorch 2.8."""
    return impl == "flash" or (impl == "cudnn" and _torch_at_least(2, 8))


def dense(x: torch.Tensor) -> torch.Tensor:
    """``x [B, H, S, D]`` as the fused kernels read it: itself when contiguous or a contiguous
    ``[B, S, H, D]`` seen as ``[B, H, S, D]`` (the layout SDPA's callers pass), else a contiguous copy
    (row slices of a longer block: misread by the fused kernels, measured on an H200 with wrong dQ/dK
    and illegal memory accesses with cuDNN)."""
    return x if x.is_contiguous() or x.transpose(1, 2).is_contiguous() else x.contiguous()


def _impl(q: torch.Tensor, prefer_cudnn: bool) -> str:
    if q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 128 and q.shape[-1] % 8 == 0:
        if prefer_cudnn and hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention_backward") \
                and torch.backends.cudnn.is_available():
            return "cudnn"
        return "flash"
    return "efficient"


def _bias(mask, q):
    """Additive bias ``[B, H, Sq, Sk]`` (a broadcast view) for the memory-efficient kernel, its
    rows padded to a multiple of 16 elements as that kernel requires; ``None`` without a mask."""
    if mask is None:
        return None
    sq, sk = mask.shape
    padded = torch.zeros(sq, math.ceil(sk / 16) * 16, dtype=q.dtype, device=q.device)
    padded[:, :sk] = mask_bias(mask, q.dtype)
    return padded[:, :sk].expand(q.shape[0], q.shape[1], sq, sk)


class SdpaKernel:
    """CUDA SDPA ops: cuDNN or flash for 16-bit inputs, memory-efficient for float32."""

    name = "sdpa"
    # partial blocks: memory-efficient kernel + bias, in float32 (16-bit blocks copied); a V head size
    # of its own by zero-padding the block (pad_head_dims)
    supports = frozenset({"mask", "v_head_dim"})
    supports_mask = True
    fp32_grads = False
    float32 = True  # the memory-efficient kernel

    def __init__(self, prefer_cudnn: bool = True) -> None:
        self.prefer_cudnn = prefer_cudnn
        # 16-bit partial (explicitly masked) blocks: the memory-efficient kernel's backward with a
        # bias gave wrong dQ/dK (NaN or ~0.4 relative error) for bf16 and fp16 on an H200 with
        # torch 2.11 while float32 was exact, so those blocks run it on float32 copies

    def forward(self, q, k, v, scale, causal, mask=None, mods=None):
        if mask is not None and q.dtype != torch.float32:  # see __init__: float32 copies of the block
            return self.forward(q.float(), k.float(), v.float(), scale, causal, mask=mask)
        dv = v.shape[-1]
        if dv != q.shape[-1]:
            out, lse = self.forward(*pad_head_dims(q, k, v), scale, causal, mask=mask)
            return out[..., :dv], lse
        hq = q.shape[1]
        impl = "efficient" if mask is not None else _impl(q, self.prefer_cudnn)
        if not native_gqa(impl):
            k, v = expand_kv(k, hq), expand_kv(v, hq)
        q, k, v = (dense(x) if impl != "efficient" else x.contiguous() for x in (q, k, v))
        sq = q.shape[-2]
        bias = _bias(mask, q)
        if impl == "cudnn":
            res = torch.ops.aten._scaled_dot_product_cudnn_attention(
                q, k, v, None, True, 0.0, causal, False, scale=scale)
            return res[0], res[1].reshape(res[1].shape[:3]).float()  # lse [B, H, S, 1] -> [B, H, S]
        if impl == "flash":
            res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
            return res[0], res[1][..., :sq]
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, bias, True, 0.0, causal, scale=scale)
        return out, lse[..., :sq]

    def backward(self, dout, q, k, v, out, lse, scale, causal, mask=None, mods=None):
        if mask is not None and q.dtype != torch.float32:
            return self.backward(dout.float(), q.float(), k.float(), v.float(), out.float(), lse, scale, causal,
                                 mask=mask)
        d, dv = q.shape[-1], v.shape[-1]
        if d != dv:
            if dv < d:
                dout, out = (torch.nn.functional.pad(x, (0, d - dv)) for x in (dout, out))
            dq, dk, dv_ = self.backward(dout, *pad_head_dims(q, k, v), out, lse, scale, causal, mask=mask)
            return dq[..., :d], dk[..., :d], dv_[..., :dv]
        hq, hkv = q.shape[1], k.shape[1]
        impl = "efficient" if mask is not None else _impl(q, self.prefer_cudnn)
        if not native_gqa(impl):
            k, v = expand_kv(k, hq), expand_kv(v, hq)
        fix = dense if impl != "efficient" else (lambda x: x.contiguous())
        dout, q, k, v, out = (fix(x) for x in (dout, q, k, v, out))
        lse = lse.contiguous()
        sq, sk = q.shape[-2], k.shape[-2]
        bias = _bias(mask, q)
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        if impl == "cudnn":
            dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
                dout, q, k, v, out, lse.unsqueeze(-1).contiguous(), seed, seed, None, None, None,
                sq, sk, 0.0, causal, scale=scale)
        elif impl == "flash":
            # None = undefined tensors: dense (not varlen) sequences, no dropout RNG state
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                dout, q, k, v, out, lse, None, None, sq, sk,
                0.0, causal, None, None, scale=scale)
        else:
            padded = math.ceil(sq / 32) * 32
            lse_p = lse.new_zeros(*lse.shape[:-1], padded)
            lse_p[..., :sq] = lse
            dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
                dout, q, k, v, bias, out, lse_p, seed, seed, 0.0,
                [True, True, True, False], causal, scale=scale)
        return dq, reduce_kv_grad(dk, hkv), reduce_kv_grad(dv, hkv)

"""The ``flash-attn`` package's CUDA kernels (optional extra ``burstattn[cuda]``).

flash-attn takes ``[B, S, H, D]``; the engine's ``[B, H, S, D]`` tensors are passed as
transposed views (last dimension contiguous, as flash-attn requires). GQA is native, and so is
softcapping (``softcap=``, flash-attn >= 2.6). ALiBi is not used: flash-attn's slopes act on
block-local positions, while a ring block sits at global offsets.
The low-level backward's keyword names changed across 2.x releases (``window_size`` became
``window_size_left/right``), so the call is built from its signature once.
"""
from __future__ import annotations

import importlib.util
import inspect

import torch

from .base import pad_head_dims


def flash_attn_available() -> bool:
    """Whether CUDA is present and the flash-attn package can be imported."""
    return torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


class FlashAttnKernel:
    """flash-attn 2.x: ``flash_attn_func(..., return_attn_probs=True)`` forward, low-level backward."""

    name = "flash_attn"
    # partially masked blocks go to the sdpa kernel (see engine.compute.BlockCalls)
    supports = frozenset({"softcap", "v_head_dim"})
    supports_mask = False
    fp32_grads = False
    float32 = False

    def __init__(self, deterministic: bool = False) -> None:
        from flash_attn import flash_attn_func
        from flash_attn.flash_attn_interface import _flash_attn_backward
        self._fwd = flash_attn_func
        self._bwd = _flash_attn_backward
        self._bwd_params = set(inspect.signature(_flash_attn_backward).parameters)
        self.deterministic = deterministic

    @staticmethod
    def _softcap(mods) -> float:
        if mods is not None and mods.alibi is not None:
            raise ValueError("flash_attn kernel: ALiBi is not supported (engine bug)")
        return 0.0 if mods is None or mods.softcap is None else float(mods.softcap)

    def forward(self, q, k, v, scale, causal, mask=None, mods=None):
        if mask is not None:
            raise ValueError("flash_attn kernel: explicit masks are not supported (engine bug)")
        dv = v.shape[-1]
        q, k, v = pad_head_dims(q, k, v)
        extra = {"softcap": self._softcap(mods)} if mods is not None and mods.softcap is not None else {}
        out, lse, _ = self._fwd(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                dropout_p=0.0, softmax_scale=scale, causal=causal,
                                return_attn_probs=True, **extra)
        return out.transpose(1, 2)[..., :dv], lse

    def backward(self, dout, q, k, v, out, lse, scale, causal, mask=None, mods=None):
        if mask is not None:
            raise ValueError("flash_attn kernel: explicit masks are not supported (engine bug)")
        d, dv_size = q.shape[-1], v.shape[-1]
        q, k, v = pad_head_dims(q, k, v)
        if dv_size < d:
            dout, out = (torch.nn.functional.pad(x, (0, d - dv_size)) for x in (dout, out))
        t = [x.transpose(1, 2) for x in (dout, q, k, v, out)]
        dq, dk, dv = (torch.empty_like(x) for x in t[1:4])
        kwargs = dict(dropout_p=0.0, softmax_scale=scale, causal=causal, alibi_slopes=None,
                      deterministic=self.deterministic)
        if "window_size_left" in self._bwd_params:
            kwargs.update(window_size_left=-1, window_size_right=-1)
        else:
            kwargs["window_size"] = (-1, -1)
        if "softcap" in self._bwd_params:
            kwargs["softcap"] = self._softcap(mods)
        self._bwd(*t, lse.contiguous(), dq, dk, dv, **kwargs)
        return (dq.transpose(1, 2)[..., :d], dk.transpose(1, 2)[..., :d],
                dv.transpose(1, 2)[..., :dv_size])

"""The ``flash-attn`` package's CUDA kernels (optional extra ``burstattn[cuda]``).

flash-attn takes ``[B, S, H, D]``; the engine's ``[B, H, S, D]`` tensors are passed as
transposed views (last dimension contiguous, as flash-attn requires). GQA is native.
The low-level backward's keyword names changed across 2.x releases (``window_size`` became
``window_size_left/right``), so the call is built from its signature once.
"""
from __future__ import annotations

import importlib.util
import inspect

import torch


def flash_attn_available() -> bool:
    """Whether CUDA is present and the flash-attn package can be imported."""
    return torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


class FlashAttnKernel:
    """flash-attn 2.x: ``flash_attn_func(..., return_attn_probs=True)`` forward, low-level backward."""

    name = "flash_attn"
    supports_mask = False  # partially masked blocks go to the sdpa kernel (see engine.passes.BlockCalls)

    def __init__(self) -> None:
        from flash_attn import flash_attn_func
        from flash_attn.flash_attn_interface import _flash_attn_backward
        self._fwd = flash_attn_func
        self._bwd = _flash_attn_backward
        self._bwd_params = set(inspect.signature(_flash_attn_backward).parameters)

    def forward(self, q, k, v, scale, causal, mask=None):
        if mask is not None:
            raise ValueError("flash_attn kernel: explicit masks are not supported (engine bug)")
        out, lse, _ = self._fwd(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                dropout_p=0.0, softmax_scale=scale, causal=causal,
                                return_attn_probs=True)
        return out.transpose(1, 2), lse

    def backward(self, dout, q, k, v, out, lse, scale, causal, mask=None):
        if mask is not None:
            raise ValueError("flash_attn kernel: explicit masks are not supported (engine bug)")
        t = [x.transpose(1, 2) for x in (dout, q, k, v, out)]
        dq, dk, dv = (torch.empty_like(x) for x in t[1:4])
        kwargs = dict(dropout_p=0.0, softmax_scale=scale, causal=causal, alibi_slopes=None,
                      deterministic=False)
        if "window_size_left" in self._bwd_params:
            kwargs.update(window_size_left=-1, window_size_right=-1)
        else:
            kwargs["window_size"] = (-1, -1)
        if "softcap" in self._bwd_params:
            kwargs["softcap"] = 0.0
        self._bwd(*t, lse.contiguous(), dq, dk, dv, **kwargs)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)

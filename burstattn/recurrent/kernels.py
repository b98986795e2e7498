"""Which kernel runs a rank's per-segment recurrence: the torch chunked forms or flash-linear-attention's.

The state passing (:mod:`.passing`) needs, per segment, the chunked recurrence from a given initial state
and its final state: exactly what flash-linear-attention's (``fla``) Triton kernels compute
(``initial_state=``, ``output_final_state=True``). On CUDA tensors with ``fla`` importable, ``"auto"`` runs
them; everywhere else (CPU, float64, no ``fla``) the torch chunked forms of :mod:`.chunked` run, which stay
the reference. ``fla`` is imported only when its kernel is called (nothing here at import time).

* the gated delta rule (Gated DeltaNet): ``fla.ops.gated_delta_rule.chunk_gated_delta_rule``;
* KDA (a decay per channel): ``fla.ops.kda.chunk_kda``;
* linear attention with a scalar decay (SSD, lightning): ``fla.ops.simple_gla.chunk_simple_gla``.

All take ``[B, T, H, d]`` inputs, a log decay ``g`` and return ``(o, final state [B, H, dk, dv])`` in
float32 state, the convention of :mod:`.chunked`.
"""
from __future__ import annotations

import importlib.util
from typing import Optional

import torch

KERNELS = ("auto", "torch", "fla")
FLA_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # Triton's dots: no float64


def is_fake(t: torch.Tensor) -> bool:
    """Whether ``t`` is a FakeTensor (the dry run's)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def fla_available() -> bool:
    """Whether flash-linear-attention is importable (looked up, not imported)."""
    return importlib.util.find_spec("fla") is not None


def segment_backend(device: torch.device, available: bool, dtype: Optional[torch.dtype] = None) -> str:
    """``"fla"`` for CUDA tensors (of a dtype its kernels take) when ``available``, else ``"torch"``."""
    ok = torch.device(device).type == "cuda" and available and (dtype is None or dtype in FLA_DTYPES)
    return "fla" if ok else "torch"


def kernel_problem(kernel, device: torch.device, dtype: torch.dtype, available: Optional[bool] = None
                   ) -> Optional[str]:
    """Why ``kernel`` cannot run on these tensors (``None``: it can)."""
    if kernel not in KERNELS:
        return f"kernel must be one of {KERNELS}, got {kernel!r}"
    if kernel != "fla":
        return None
    if torch.device(device).type != "cuda":
        return f"kernel='fla' runs flash-linear-attention's Triton kernels on CUDA tensors, got {device} tensors " \
               f"(kernel='torch' or 'auto' runs the torch chunked form)"
    if not (fla_available() if available is None else available):
        return "kernel='fla' needs flash-linear-attention (pip install flash-linear-attention), not importable here"
    if dtype not in FLA_DTYPES:
        return f"kernel='fla' takes {[str(d) for d in FLA_DTYPES]} inputs, got {dtype} (kernel='torch' for float64)"
    return None


def resolve_kernel(kernel: str, device: torch.device, dtype: torch.dtype, fake: bool = False) -> str:
    """``"torch"`` or ``"fla"`` for a valid ``kernel`` (:func:`kernel_problem` returned ``None``). ``fake``:
    the tensors are the dry run's fake tensors (no Triton kernel runs on them): the torch form."""
    if fake:
        return "torch"
    if kernel == "auto":
        return segment_backend(device, fla_available(), dtype)
    return kernel


def fla_delta_rule(q, k, v, g, beta, *, scale, initial_state, use_qk_l2norm: bool):
    """flash-linear-attention's gated delta rule (``g [B, T, H]``) or KDA (``g [B, T, H, dk]``) from
    ``initial_state [B, H, dk, dv]`` (float32): ``(o [B, T, H, dv], final state)``."""
    kw = dict(scale=q.shape[-1] ** -0.5 if scale is None else scale, initial_state=initial_state.float(),
              output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm)
    if g.dim() == 4:
        from fla.ops.kda import chunk_kda

        return chunk_kda(q, k, v, g, beta, **kw)
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return chunk_gated_delta_rule(q, k, v, g, beta, **kw)


def fla_linear_attention(q, k, v, g, *, scale: float):
    """flash-linear-attention's linear attention with a scalar log decay ``g [B, T, H]`` from a zero state:
    ``(o [B, T, H, dv], final state [B, H, dk, dv])``."""
    from fla.ops.simple_gla import chunk_simple_gla

    return chunk_simple_gla(q, k, v, g, scale=scale, output_final_state=True)


def fla_delta_local(scale, use_qk_l2norm: bool):
    """The state passing's per-segment function (:func:`~.passing.state_passing`'s ``local``) on
    flash-linear-attention's kernel: the identity columns next to ``v`` carry the transition, as the torch
    form's (``o0``, ``corr``, ``A``, ``B`` from one call)."""
    def local(q, k, v, g, beta):
        b, L, H, dk = k.shape
        dv = v.shape[-1]
        v_aug = torch.cat([v, v.new_zeros(b, L, H, dk)], -1)  # [b, L, H, dv + dk]
        init = torch.cat([v.new_zeros(b, H, dk, dv), torch.eye(dk, dtype=v.dtype, device=v.device).expand(
            b, H, dk, dk)], -1)  # [b, H, dk, dv + dk]: zero state, identity transition
        o, S = fla_delta_rule(q, k, v_aug, g, beta, scale=scale, initial_state=init, use_qk_l2norm=use_qk_l2norm)
        o, S = o.to(v.dtype), S.to(v.dtype)
        return o[..., :dv], o[..., dv:], S[..., dv:], S[..., :dv]
    return local


def fla_linear_local(scale: float):
    """As :func:`fla_delta_local` for linear attention with a scalar decay: ``corr = scale q_t exp(G_t)``
    and ``A = exp(G_L)`` from the prefix sums of ``g`` (no difference involved)."""
    def local(q, k, v, g):
        o, S = fla_linear_attention(q, k, v, g, scale=scale)
        G = g.cumsum(1)  # [b, L, H]
        return o.to(v.dtype), q * scale * G.exp().unsqueeze(-1), G[:, -1].exp(), S.to(v.dtype)
    return local

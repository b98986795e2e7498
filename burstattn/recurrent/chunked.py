"""Single-process chunked forms of the linear recurrences (plain PyTorch, differentiable).

Every recurrence here keeps, per head, a state ``S [dk, dv]`` and reads it with the query,
``o_t = q_t @ S_t`` (row vector ``q_t [dk]``), in the ``[batch, seq, heads, dim]`` convention of
transformers' reference implementations:

* :func:`chunk_delta_rule`: the gated delta rule (Gated DeltaNet; Kimi's KDA with a per-channel
  decay): ``S_t = diag(exp(g_t)) S_{t-1}``, then ``S_t += beta_t k_t (v_t - k_t @ S_t)^T``.
  Ported from ``torch_chunk_gated_delta_rule`` (qwen3_next) and ``chunk_kimi_delta_attention``
  (kimi_linear): same UT transform, same per-chunk scan.
* :func:`chunk_linear_attention`: linear attention with a scalar decay per token and head,
  ``S_t = exp(g_t) S_{t-1} + k_t v_t^T`` (Mamba2's SSD with ``q = C, k = dt * B, v = x, g = dt * A``;
  lightning attention with a constant ``g = -slope``).

Every column of ``S`` evolves independently of the others given ``(q, k, g, beta)``: the state
passing in :mod:`burstattn.recurrent.passing` relies on it (it runs identity columns next to
``v`` to obtain the chunk's transition). Inputs of 16-bit types are computed in float32, float64
stays float64; the output has the input's dtype, the state the compute dtype. The decays inside a
chunk are segment sums (:mod:`.decay`), not differences of prefix sums.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..config import accum_dtype
from .decay import chunk_decays


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """FLA's l2 normalisation over the last dim (``x / sqrt(sum x^2 + eps)``), as transformers."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _chunks(x: torch.Tensor, pad: int, size: int) -> torch.Tensor:
    """``[B, H, T, ...]`` -> zero-padded ``[B, H, T_pad / size, size, ...]``."""
    if pad:
        x = F.pad(x, (0, 0) * (x.dim() - 3) + (0, pad))
    return x.reshape(x.shape[0], x.shape[1], -1, size, *x.shape[3:])


def chunk_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     *, chunk_size: int = 64, initial_state: Optional[torch.Tensor] = None,
                     scale: Optional[float] = None, use_qk_l2norm: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule in chunks.

    Args:
        q, k: ``[B, T, H, dk]`` (same heads as ``v``: repeat grouped heads first).
        v: ``[B, T, H, dv]``.
        g: log decay, ``[B, T, H]`` (Gated DeltaNet) or ``[B, T, H, dk]`` (KDA, per channel); <= 0.
        beta: ``[B, T, H]``, the delta rule's write strength.
        chunk_size: tokens per chunk (any positive int; the math does not depend on it).
        initial_state: ``[B, H, dk, dv]`` or ``None`` (zeros).
        scale: query scale, ``dk ** -0.5`` for ``None``.
        use_qk_l2norm: l2-normalise q and k first (transformers' ``use_qk_l2norm_in_kernel``).
    Returns:
        ``(o [B, T, H, dv] in q's dtype, final state [B, H, dk, dv] in the compute dtype)``.
    """
    in_dtype, dtype = q.dtype, accum_dtype(q.dtype)
    channel = g.dim() == 4
    B, T, H, dk = k.shape
    q, k, v, beta, g = (x.transpose(1, 2).to(dtype) for x in (q, k, v, beta, g))  # [B, H, T, ...]
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * (dk ** -0.5 if scale is None else scale)
    C = chunk_size
    pad = (C - T % C) % C
    if not channel:
        g = g.unsqueeze(-1)  # [B, H, T, 1]: one decay for every channel
    q, k, v, g = (_chunks(x, pad, C) for x in (q, k, v, g))  # [B, H, nc, C, d]
    beta = _chunks(beta.unsqueeze(-1), pad, C)  # [B, H, nc, C, 1]; padded tokens write nothing
    # G: log decay from the chunk's start through token i [B, H, nc, C, 1 or dk]; pair: the decay from j to
    # i (j <= i) as segment sums, [B, H, nc, C, C] or per channel [B, H, nc, C, C, dk] (KDA's decay_mask)
    G, pair, to_end = chunk_decays(g)
    upper = torch.ones(C, C, dtype=torch.bool, device=q.device).triu(1)
    k_beta, v_beta = k * beta, v * beta
    if channel:
        ut = torch.einsum("...ic,...jc,...ijc->...ij", k_beta, k, pair)
        intra = torch.einsum("...ic,...jc,...ijc->...ij", q, k, pair)
    else:
        ut = (k_beta @ k.transpose(-1, -2)) * pair
        intra = (q @ k.transpose(-1, -2)) * pair
    intra = intra.masked_fill(upper, 0.0)
    # the UT transform: (I + strictly-lower(ut))^-1 applied to beta*v and to the decayed beta*k
    new_values = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut, k_beta * G.exp(), upper=False, unitriangular=True)
    q_dec = q * G.exp()
    k_dec = k * to_end.exp()
    chunk_decay = G[..., -1, :].exp().unsqueeze(-1)  # [B, H, nc, 1 or dk, 1]: scales the state's rows
    S = (torch.zeros(B, H, dk, v.shape[-1], dtype=dtype, device=q.device) if initial_state is None
         else initial_state.to(dtype))
    outs = []
    for i in range(q.shape[2]):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ S
        outs.append(q_dec[:, :, i] @ S + intra[:, :, i] @ v_new)
        S = S * chunk_decay[:, :, i] + k_dec[:, :, i].transpose(-1, -2) @ v_new
    o = torch.stack(outs, dim=2).reshape(B, H, -1, v.shape[-1])[:, :, :T]  # [B, H, T, dv]
    return o.transpose(1, 2).to(in_dtype), S


def chunk_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, *,
                           chunk_size: int = 64, initial_state: Optional[torch.Tensor] = None,
                           scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Linear attention with a scalar decay per token and head, in chunks.

    ``S_t = exp(g_t) S_{t-1} + k_t v_t^T``, ``o_t = scale * q_t @ S_t``.

    Args:
        q, k: ``[B, T, H, dk]``; v: ``[B, T, H, dv]``; g: ``[B, T, H]`` log decay (<= 0).
        initial_state: ``[B, H, dk, dv]`` or ``None``.
    Returns:
        ``(o [B, T, H, dv], final state [B, H, dk, dv] in the compute dtype)``.
    """
    in_dtype, dtype = q.dtype, accum_dtype(q.dtype)
    B, T, H, dk = k.shape
    q, k, v, g = (x.transpose(1, 2).to(dtype) for x in (q, k, v, g))
    q = q * scale
    C = chunk_size
    pad = (C - T % C) % C
    q, k, v, g = (_chunks(x, pad, C) for x in (q, k, v, g.unsqueeze(-1)))
    G, pair, to_end = chunk_decays(g)  # [B, H, nc, C, 1], [B, H, nc, C, C] (segment sums), [B, H, nc, C, 1]
    intra = (q @ k.transpose(-1, -2)) * pair  # [B, H, nc, C, C], zero above the diagonal
    q_dec = q * G.exp()
    k_dec = k * to_end.exp()
    chunk_decay = G[..., -1, :].exp().unsqueeze(-1)  # [B, H, nc, 1, 1]
    S = (torch.zeros(B, H, dk, v.shape[-1], dtype=dtype, device=q.device) if initial_state is None
         else initial_state.to(dtype))
    outs = []
    for i in range(q.shape[2]):
        outs.append(q_dec[:, :, i] @ S + intra[:, :, i] @ v[:, :, i])
        S = S * chunk_decay[:, :, i] + k_dec[:, :, i].transpose(-1, -2) @ v[:, :, i]
    o = torch.stack(outs, dim=2).reshape(B, H, -1, v.shape[-1])[:, :, :T]
    return o.transpose(1, 2).to(in_dtype), S


def recurrent_reference(q, k, v, g, beta=None, *, initial_state=None, scale=None, use_qk_l2norm=False,
                        resets=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token definition of both recurrences (the tests' oracle), in q's dtype.

    ``beta=None``: linear attention with decay (``scale`` defaults to 1); otherwise the gated
    delta rule (``scale`` defaults to ``dk ** -0.5``). ``resets``: bool ``[T]``, True where the
    state restarts from zero (a document's first token). Shapes as :func:`chunk_delta_rule`.
    """
    B, T, H, dk = k.shape
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * ((dk ** -0.5 if beta is not None else 1.0) if scale is None else scale)
    S = torch.zeros(B, H, dk, v.shape[-1], dtype=q.dtype) if initial_state is None else initial_state
    outs = []
    for t in range(T):
        if resets is not None and bool(resets[t]) and t > 0:
            S = torch.zeros_like(S)
        decay = g[:, t].exp()
        S = S * (decay.unsqueeze(-1) if g.dim() == 4 else decay[..., None, None].expand(-1, -1, dk, 1))
        kt = k[:, t].unsqueeze(-1)  # [B, H, dk, 1]
        if beta is None:
            S = S + kt * v[:, t].unsqueeze(-2)
        else:
            delta = (v[:, t] - (S * kt).sum(-2)) * beta[:, t].unsqueeze(-1)  # [B, H, dv]
            S = S + kt * delta.unsqueeze(-2)
        outs.append((q[:, t].unsqueeze(-1) * S).sum(-2))
    return torch.stack(outs, dim=1), S

"""Attention of a whole sequence on one rank, for the strategies that gather a full sequence or full
heads onto a rank (ulysses, tp): one call of the resolved local kernel (the one kernel choice,
:func:`burstattn.kernels.resolve_backend`) on the whole sequence, or under a mask the engine at a world
of one (its world-of-one mask plan computes only the block ops the mask leaves non-empty).

A dense call is one kernel block: the engine's loop would add its copies (the ``[B, h, n, D]`` query
and K/V blocks, the float32 accumulators) to a sequence the rank already holds whole, doubling these
strategies' attention memory for nothing it could skip.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from ..call.call import Call
from ..call.engine_adapter import backward_pass, forward_pass
from ..comm.groups import GroupContext
from ..engine.compute import backward_lse
from ..kernels import get_kernel
from ..masks.plan import MaskPlan, mask_plan

ALONE = GroupContext(None, 0, 1)


def _local(cfg: Call, q: torch.Tensor) -> Call:
    # the backend was resolved once, by prepare
    return replace(cfg, layout="contiguous", kv_layout=None, backward="kv", schedule="ring", topology=None,
                   grad_partials="kernel")


def local_plan(cfg: Call, seq_len: int) -> Optional[MaskPlan]:
    """The world-of-one mask plan of ``cfg.mask`` over ``seq_len`` tokens in global order (``None``
    without a mask, or with an empty one)."""
    if cfg.mask is None or cfg.mask.empty:
        return None
    return mask_plan(cfg.mask, cfg.causal, seq_len, 1, "contiguous", 0)


def local_forward(cfg: Call, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  plan: Optional[MaskPlan] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [B, N, Hq, D]``, ``k, v [B, N, Hkv, D]`` in global order -> ``out [B, N, Hq, D]`` (q's dtype)
    and ``lse [B, Hq, N]`` (float32; float64 for float64), causal on the global order."""
    local = _local(cfg, q)
    if plan is not None:
        return forward_pass(ALONE, local, plan, q, k, v)
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))  # [B, N, H, D] -> [B, H, N, D] views
    out, lse = get_kernel(local.backend).forward(qh, kh, vh, local.scale_for(q.shape[-1]), local.causal)
    return out.to(q.dtype).transpose(1, 2), lse


def local_backward(cfg: Call, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, plan: Optional[MaskPlan] = None):
    """Gradients of :func:`local_forward`: ``dq, dk, dv`` in the inputs' shapes and dtypes."""
    local = _local(cfg, q)
    if plan is not None:
        return backward_pass(ALONE, local, plan, dout, q, k, v, out, lse)[:3]
    dq, dk, dv = get_kernel(local.backend).backward(*(x.transpose(1, 2) for x in (dout.to(q.dtype), q, k, v, out)),
                                                    backward_lse(lse), local.scale_for(q.shape[-1]), local.causal)
    return dq.to(q.dtype).transpose(1, 2), dk.to(k.dtype).transpose(1, 2), dv.to(v.dtype).transpose(1, 2)

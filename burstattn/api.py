"""Public entry points: :func:`burst_attn_func` and the :class:`BurstAttention` module."""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from .autograd import BurstAttnFunction, RingContext
from .formulas import choose_backward
from .kernels import resolve_backend
from .masks.plan import choose_mask_backward
from .masks.setup import build_mask, checked_config


def ring_context(group: Optional[dist.ProcessGroup]) -> RingContext:
    """Resolve ``group`` (``None``: the default group, or a world of one without
    ``torch.distributed``)."""
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise ValueError("group was given but torch.distributed is not initialized")
        return RingContext(None, 0, 1)
    group = group if group is not None else dist.group.WORLD
    return RingContext(group, dist.get_rank(group), dist.get_world_size(group))


def burst_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                    group: Optional[dist.ProcessGroup] = None, causal: bool = False,
                    softmax_scale: Optional[float] = None, layout: str = "zigzag",
                    return_lse: bool = False, backend: str = "auto", backward: str = "auto",
                    schedule: str = "ring", window=None, cu_seqlens=None, document_ids=None,
                    mask_mod=None, mask=None, topology=None):
    """Exact softmax attention over a sequence sharded across the ranks of ``group``.

    Every rank passes its own shard (see :func:`burstattn.shard_sequence`); K/V circulate
    around the ring and partial results merge by log-sum-exp, so no rank ever holds a
    ``local_seq x seq`` score matrix.

    Args:
        q: ``[batch, local_seq, q_heads, head_dim]``.
        k, v: ``[batch, local_seq, kv_heads, head_dim]``; ``q_heads % kv_heads == 0``
            (GQA/MQA: K/V travel at kv_heads size).
        group: process group (default: the world; a world of one if torch.distributed is
            not initialised).
        causal: global token at position i attends to positions j <= i (positions per
            ``layout``).
        softmax_scale: scale of ``q @ k^T``; default ``head_dim ** -0.5``.
        layout: ``"zigzag"`` (default, balanced causal), ``"striped"`` or ``"contiguous"``:
            how the global sequence was split; must match how the inputs were sharded. Or an
            explicit :class:`burstattn.Partition` (e.g. :func:`burstattn.document_partition`).
        return_lse: also return the log-sum-exp ``[batch, q_heads, local_seq]``, float32
            (float64 for float64 inputs, which are accumulated in float64 throughout)
            (not differentiable).
        backend: local kernel: ``"auto"``, ``"cpu_flash"``, ``"sdpa"`` (CUDA),
            ``"flash_attn"`` (CUDA, optional package), ``"reference"`` (plain PyTorch).
        backward: ``"burst"`` (query ring), ``"kv"`` (K/V ring) or ``"auto"`` (fewer bytes).
        schedule: ``"ring"`` (default) or ``"distflash"``: DistFlashAttn's load-balanced
            schedule for causal attention over the contiguous layout (idle early ranks compute
            blocks of the overloaded late ranks; K/V and queries go straight to the rank that
            needs them). Needs ``causal=True``, ``layout="contiguous"``, ``backward="auto"``.

    Returns:
        ``out [batch, local_seq, q_heads, head_dim]`` in q's dtype (and ``lse``).

    Raises:
        TypeError / ValueError on every rank of the group if any rank's arguments are
        invalid or the ranks disagree on shapes or options.
    """
    ring = ring_context(group)
    mask_args = dict(window=window, cu_seqlens=cu_seqlens, document_ids=document_ids, mask_mod=mask_mod, mask=mask)
    cfg, plan = checked_config(q, k, v, ring, mask_args, "burst_attn_func", causal=bool(causal),
                               softmax_scale=softmax_scale, layout=layout, backend=backend, backward=backward,
                               schedule=schedule, topology=topology)
    mode = backward
    shape = dict(batch=q.shape[0], local_seq=q.shape[1], q_heads=q.shape[2], kv_heads=k.shape[2],
                 head_dim=q.shape[3], dtype=q.dtype)
    if mode == "auto" and plan is not None:
        mode = choose_mask_backward(**shape)
    elif mode == "auto" and schedule in ("ring", "double"):
        mode = choose_backward(world_size=ring.world_size, **shape)
    cfg = replace(cfg, backend=resolve_backend(backend, q.device, q.dtype), backward=mode)
    out, lse = BurstAttnFunction.apply(q, k, v, ring, cfg, plan)
    return (out, lse) if return_lse else out


class BurstAttention(nn.Module):
    """:func:`burst_attn_func` as a module (no parameters): ``forward(q, k, v) -> out``."""

    def __init__(self, *, group: Optional[dist.ProcessGroup] = None, causal: bool = False,
                 softmax_scale: Optional[float] = None, layout: str = "zigzag",
                 backend: str = "auto", backward: str = "auto", schedule: str = "ring", window=None,
                 cu_seqlens=None, document_ids=None, mask_mod=None, mask=None) -> None:
        super().__init__()
        self.group, self.causal, self.softmax_scale = group, causal, softmax_scale
        self.layout, self.backend, self.backward, self.schedule = layout, backend, backward, schedule
        # one AttnMask for the module's lifetime: its block summaries are built once per shape
        amask, problem = build_mask(window, cu_seqlens, document_ids, mask_mod, mask)
        if problem:
            raise problem[0](f"BurstAttention: {problem[1]}")
        self.mask = amask

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q [B, n, Hq, D]``, ``k, v [B, n, Hkv, D]`` -> ``[B, n, Hq, D]``."""
        return burst_attn_func(q, k, v, group=self.group, causal=self.causal,
                               softmax_scale=self.softmax_scale, layout=self.layout,
                               backend=self.backend, backward=self.backward, schedule=self.schedule,
                               mask=self.mask)

    def extra_repr(self) -> str:
        return f"causal={self.causal}, layout={self.layout!r}, backend={self.backend!r}, backward={self.backward!r}"

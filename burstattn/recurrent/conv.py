"""Sequence-parallel causal short convolution (Mamba's, Gated DeltaNet's and LFM2's kernel-4 conv).

Each token reads the inputs of the ``K - 1`` positions before it. Under any layout some of those
live on other ranks: every rank all-gathers the inputs others need (:func:`.segments.halo_plan`:
under ``contiguous`` its last ``K - 1`` tokens, under ``zigzag`` the last ``K - 1`` of each
chunk, under ``striped`` all of them), then convolves a window table. Packed documents: a tap
that would cross a document start reads zero, as each document convolved alone. The backward is
the all-gather's adjoint (reduce-scatter), metered like the forward under ``"halo"``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..comm.groups import group_context
from ..comm.host import host_side
from ..layouts.named import layout_or_default
from .checks import dim, tensors_problem
from .comm import all_gather
from .passing import _common_problem, _cu_key, _layout_key, check_every_rank
from .segments import halo_plan
from .window import window_conv

ACTIVATIONS = (None, "silu", "swish")


def sp_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                     activation: Optional[str] = None, group=None, layout="zigzag", cu_seqlens=None,
                     check: bool = True) -> torch.Tensor:
    """Depthwise causal convolution of this rank's shard.

    Args:
        x: ``[B, n, C]`` (channels last, as the mixers' projections).
        weight: ``[C, K]`` or ``nn.Conv1d``'s ``[C, 1, K]``: ``y_t = sum_j w[:, j] x_{t - K + 1 + j}``.
        bias: ``[C]`` or ``None``.
        activation: ``None``, ``"silu"`` or ``"swish"``.
        group, layout, cu_seqlens, check: as :func:`~burstattn.recurrent.sp_gated_delta_rule`.
    Returns:
        ``[B, n, C]`` in x's dtype (computed in float32 for 16-bit inputs).
    Raises:
        ValueError on every rank for inputs that are not floating-point tensors, bad or disagreeing shapes,
        layout, ``cu_seqlens`` or activation.
    """
    ctx = group_context(group)
    layout = layout_or_default(layout)
    problem = tensors_problem(dict(x=x, weight=weight, bias=bias), optional=("bias",))
    w = weight.reshape(weight.shape[0], weight.shape[-1]) if problem is None and weight.dim() == 3 else weight
    if problem is None:
        problem = _common_problem(x.unsqueeze(-1) if x.dim() == 3 else x, 1, layout, cu_seqlens, ctx.world_size)
    if problem is None and (x.dim() != 3 or w.dim() != 2 or w.shape[0] != x.shape[-1]):
        problem = f"x must be [batch, local_seq, channels] and weight [channels, width], got {tuple(x.shape)} " \
                  f"and {tuple(weight.shape)}"
    if problem is None and bias is not None and tuple(bias.shape) != (x.shape[-1],):
        problem = f"bias must be [{x.shape[-1]}], got {tuple(bias.shape)}"
    if problem is None and activation not in ACTIVATIONS:
        problem = f"activation must be one of {ACTIVATIONS}, got {activation!r}"
    fields = dict(kind="conv", batch=dim(x, 0), local_seq=dim(x, 1), channels=dim(x, -1), width=dim(w, -1),
                  dtype=str(getattr(x, "dtype", "")),
                  layout=_layout_key(layout) if problem is None else None,
                  cu_seqlens=_cu_key(cu_seqlens) if problem is None else None)
    if check:
        check_every_rank("sp_causal_conv1d", fields, problem, ctx.group)
    elif problem:
        raise ValueError(f"sp_causal_conv1d: {problem}")
    B, n, C = x.shape
    with host_side():  # host bookkeeping, also inside the dry run's fake mode
        plan = halo_plan(n * ctx.world_size, ctx.world_size, ctx.rank, layout, w.shape[-1], cu_seqlens)
    rows = [x]
    if ctx.world_size > 1 and plan.count:
        send = x.index_select(1, plan.send.to(x.device))  # [B, sent, C]
        send = F.pad(send, (0, 0, 0, plan.count - send.shape[1])).transpose(0, 1)  # [count, B, C]
        halo = all_gather(send.contiguous(), ctx.group, "halo")  # [P, count, B, C]
        rows.append(halo.reshape(-1, B, C).transpose(0, 1))  # [B, P * count, C]
    rows.append(x.new_zeros(B, 1, C))  # the zero row: taps before the sequence or a document start
    table = torch.cat(rows, dim=1)
    # the window [B, n, K, C] and the activation are recomputed in the backward; only the table is kept
    return window_conv(table, plan.index.to(x.device), w, bias, silu=activation in ("silu", "swish"))

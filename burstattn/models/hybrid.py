"""A hybrid decoder: Gated DeltaNet layers among full-attention layers (Qwen3-Next's pattern, ``hybrid-*``
presets), trained over context-parallel ranks exactly.

The Gated DeltaNet mixer follows transformers' ``Qwen3NextGatedDeltaNet`` (separate projections instead
of the fused ``in_proj_qkvz``/``in_proj_ba``): ``q, k, v`` projections -> causal short convolution
(silu) -> the gated delta rule with l2-normalised q/k, ``beta = sigmoid(b)``, ``g = -exp(A_log) *
softplus(a + dt_bias)`` -> gated RMSNorm (``* silu(z)``) -> ``wo``. The convolution and the
recurrence run sequence-parallel (:mod:`burstattn.recurrent`) over the attention's group and layout,
so a block of this kind slots into :class:`~burstattn.models.Llama`'s loop, FSDP units, ``remat``
and the blockwise MLP and loss unchanged. Packed documents (the attention's ``cu_seqlens`` /
``document_ids`` / ``mask``, as ``burstattn train`` passes them for ``--doc-lengths`` and ``--data``
with document boundaries) restart the convolution and the recurrence at every document start, as
each document run alone. Tensor parallelism is refused (its plans split attention projections).
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..comm.groups import group_context
from ..comm.host import host_side
from ..layouts.named import layout_or_default
from ..layouts.partition import Partition
from ..masks.spec import MASK_KEYWORDS, make_mask
from ..recurrent import sp_causal_conv1d, sp_gated_delta_rule
from ..strategies.usp import usp_positions
from .blockwise import blockwise_rows
from .checkpointing import LayerRun, checkpointed
from .config import HybridConfig, LlamaConfig, recurrent_tp_problem
from .llama import AttnFn, Llama, TransformerBlock
from .recompute import kept_inputs


def mixer_context(attn: Optional[AttnFn], seq_len: int) -> tuple:
    """``(group, layout)`` the recurrent layers must use to match the attention ``attn`` (an
    :class:`~burstattn.models.AttnCall`; any other callable: one process). ``usp``: its grid
    layout as a Partition; one process: ``contiguous`` (as the attention runs there, any length).
    Raises ``ValueError`` for the tensor-parallel strategies."""
    strategy = getattr(attn, "strategy", None)
    if strategy is None:
        return None, "contiguous"
    problem = recurrent_tp_problem(strategy)
    if problem:
        raise ValueError(problem)
    if _group_size(attn.group) == 1:
        return attn.group, "contiguous"
    layout = layout_or_default(attn.layout)
    if strategy == "usp":
        mesh = attn.options["mesh"]
        ring, uly = mesh.size(0), mesh.size(1)
        with host_side():  # positions are host bookkeeping (real tensors in a dry run too)
            layout = Partition(tuple(usp_positions(seq_len, ring_rank=c // uly, ring_degree=ring, ulysses_rank=c % uly,
                                                   ulysses_degree=uly, layout=layout) for c in range(ring * uly)),
                               name="usp")
    return attn.group, layout


MASK_OPTIONS = MASK_KEYWORDS
"""The attention options that describe its mask (:class:`burstattn.masks.spec.MaskKeywords`' fields)."""


def mixer_documents(attn: Optional[AttnFn]) -> Optional[torch.Tensor]:
    """The packed documents of the attention ``attn`` (an :class:`~burstattn.models.AttnCall`): its
    mask's boundaries ``cu_seqlens [D + 1]`` over the global sequence (int64), or ``None`` (one
    sequence; a window alone leaves the recurrence whole).

    Raises:
        ValueError: the options' mask is invalid (the attention's own message), or it is a ``mask_mod``,
            from which the recurrent layers cannot tell where documents start.
    """
    options = getattr(attn, "options", None) or {}
    mask = make_mask(**{name: options.get(name) for name in MASK_OPTIONS})
    if mask is None:
        return None
    if mask.mask_mod is not None:
        raise ValueError("hybrid models: a mask_mod does not tell the Gated DeltaNet layers where documents start; "
                         "pass the documents as cu_seqlens or document_ids (or an AttnMask of them)")
    return mask.bounds


class GatedDeltaNet(nn.Module):
    """Qwen3-Next's linear-attention mixer: ``x [B, n, dim]`` -> ``[B, n, Hv, dv]`` (before ``wo``)."""

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        c = config
        self.config = c
        hk, hv = c.linear_num_key_heads * c.linear_key_head_dim, c.linear_num_value_heads * c.linear_value_head_dim
        self.wq = nn.Linear(c.dim, hk, bias=False)
        self.wk = nn.Linear(c.dim, hk, bias=False)
        self.wv = nn.Linear(c.dim, hv, bias=False)
        self.wz = nn.Linear(c.dim, hv, bias=False)
        self.wb = nn.Linear(c.dim, c.linear_num_value_heads, bias=False)
        self.wa = nn.Linear(c.dim, c.linear_num_value_heads, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(2 * hk + hv, c.linear_conv_kernel_dim))
        self.A_log = nn.Parameter(torch.empty(c.linear_num_value_heads))
        self.dt_bias = nn.Parameter(torch.ones(c.linear_num_value_heads))
        self.norm_weight = nn.Parameter(torch.ones(c.linear_value_head_dim))
        self.wo = nn.Linear(hv, c.dim, bias=False)
        self.reset_recurrent()

    def reset_recurrent(self, generator: Optional[torch.Generator] = None) -> None:
        """Initialise the non-linear-layer parameters as transformers does (conv: Conv1d's uniform,
        ``A`` uniform in (0, 16), ``dt_bias`` and the norm ones)."""
        with torch.no_grad():
            bound = 1.0 / math.sqrt(self.conv_weight.shape[1])
            self.conv_weight.uniform_(-bound, bound, generator=generator)
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1e-3, 16, generator=generator).log())
            self.dt_bias.fill_(1.0)
            self.norm_weight.fill_(1.0)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attn: Optional[AttnFn]) -> torch.Tensor:
        c = self.config
        b, n, _ = x.shape
        group, layout = mixer_context(attn, n * _group_size(getattr(attn, "group", None)))
        docs = mixer_documents(attn)  # every document restarts the conv and the state, as run alone
        hk = c.linear_num_key_heads * c.linear_key_head_dim
        conv = functools.partial(self.conv_qkv, group=group, layout=layout, docs=docs)
        qkv = kept_inputs(conv, x, self.wq.weight, self.wk.weight, self.wv.weight, self.conv_weight)
        q, k, v = qkv.split([hk, hk, qkv.shape[-1] - 2 * hk], dim=-1)
        q = q.reshape(b, n, c.linear_num_key_heads, c.linear_key_head_dim)
        k = k.reshape(b, n, c.linear_num_key_heads, c.linear_key_head_dim)
        v = v.reshape(b, n, c.linear_num_value_heads, c.linear_value_head_dim).contiguous()  # not a view of qkv (freed)
        wide = torch.promote_types(x.dtype, torch.float32)  # the gates and norm in float32 at least
        beta = torch.sigmoid(self.wb(x))  # [B, n, Hv]
        g = -self.A_log.to(wide).exp() * F.softplus(self.wa(x).to(wide) + self.dt_bias.to(wide))
        o, _ = sp_gated_delta_rule(q, k, v, g, beta, group=group, layout=layout, cu_seqlens=docs,
                                   chunk_size=c.linear_chunk, use_qk_l2norm=True)
        return kept_inputs(self.gate, o, x, self.wz.weight, self.norm_weight, per_token=2)

    def conv_qkv(self, x, wq, wk, wv, conv_weight, *, group, layout, docs) -> torch.Tensor:
        """``x [B, n, dim]`` -> ``silu(conv(x [wq | wk | wv]^T))`` ``[B, n, 2 hk + hv]`` (sequence parallel)."""
        qkv = torch.cat([F.linear(x, wq), F.linear(x, wk), F.linear(x, wv)], dim=-1)  # [B, n, 2 hk + hv]
        return sp_causal_conv1d(qkv, conv_weight, activation="silu", group=group, layout=layout, cu_seqlens=docs)

    def gate(self, o: torch.Tensor, x: torch.Tensor, wz: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
        """Gated RMSNorm: ``o [B, n, Hv, dv]``, ``x [B, n, dim]`` -> ``norm(o) * silu(x wz^T)`` in x's dtype."""
        c = self.config
        wide = torch.promote_types(x.dtype, torch.float32)
        o = o.to(wide)
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + c.norm_eps) * norm_weight.to(wide)
        z = F.linear(x, wz).view(*o.shape)
        return (o * F.silu(z.to(wide))).to(x.dtype)


def _group_size(group) -> int:
    return group_context(group).world_size


class GatedDeltaNetBlock(TransformerBlock):
    """A pre-norm block whose mixer (still named ``attention``) is :class:`GatedDeltaNet`."""

    def __init__(self, config: HybridConfig) -> None:
        super().__init__(config)
        self.attention = GatedDeltaNet(config)

    def layer(self, x: torch.Tensor, positions: torch.Tensor, attn: AttnFn, run: LayerRun) -> torch.Tensor:
        if run.checkpointing == "remat":  # the mixer recomputed in the backward (its collectives too)
            out = checkpointed(self.attend, x, positions, attn)
        else:
            out = self.attend(x, positions, attn)
        return blockwise_rows(self.finish, x, out, chunk=run.mlp_chunk, recompute=run.mlp_recomputed, shards=1)


class HybridLlama(Llama):
    """:class:`~burstattn.models.Llama` with :class:`GatedDeltaNetBlock` where ``config.is_attention(i)``
    is false. Same arguments, forward and outputs."""

    def __init__(self, config: HybridConfig, **kw) -> None:
        super().__init__(config, **kw)
        for i in range(config.n_layers):
            if not config.is_attention(i):
                self.layers[i] = GatedDeltaNetBlock(config)
        self.init_weights()

    def init_weights(self, generator: Optional[torch.Generator] = None) -> None:
        super().init_weights(generator)
        for module in self.modules():
            if isinstance(module, GatedDeltaNet):
                module.reset_recurrent(generator)


def model_class(config: LlamaConfig) -> type:
    """:class:`HybridLlama` for a :class:`HybridConfig`, else :class:`Llama`."""
    return HybridLlama if isinstance(config, HybridConfig) else Llama

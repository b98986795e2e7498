"""A LLaMA-family decoder whose attention is any distributed strategy of :func:`burstattn.attention`.

Module names follow torchtitan / Meta's reference implementation (``tok_embeddings``,
``layers[i].attention.wq``, ``feed_forward.w1`` ...), so tensor-parallel plans and weight maps
read the same. Every forward takes the GLOBAL positions of the tokens it holds: a rank holding a
sequence shard passes ``burstattn.sequence_positions(...)`` for its layout, and rotary embeddings
and the causal mask then match the unsharded model exactly.

Shapes: ``tokens [B, n]`` (int64, this rank's shard of a global sequence of N tokens),
``positions [n]`` (int64), hidden states ``[B, n, dim]``, logits ``[B, n, vocab_size]``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..strategies import attention as distributed_attention
from .checkpointing import check_checkpointing, segment_runner
from .config import LlamaConfig
from .norms import RMSNorm
from .rope import apply_rotary

AttnFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class AttnCall:
    """The causal distributed attention a model calls: ``(q [B, n, Hq, D], k, v [B, n, Hkv, D]) ->
    [B, n, Hq, D]`` through ``burstattn.attention(strategy=..., group=..., layout=..., **options)``.

    ``group`` is the context-parallel group (``None``: the default group, or one process).
    ``layout`` must be the layout the tokens were sharded with."""

    strategy: str = "burst"
    group: Optional[dist.ProcessGroup] = None
    layout: Optional[str] = None
    options: dict = field(default_factory=dict)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return distributed_attention(q, k, v, strategy=self.strategy, group=self.group, causal=True,
                                     layout=self.layout, **self.options)


class Attention(nn.Module):
    """Grouped-query attention: ``wq`` (dim -> Hq*hd), ``wk``/``wv`` (dim -> Hkv*hd), ``wo`` (Hq*hd -> dim).

    Head counts are read from the projection outputs (``-1`` in the views), so a tensor-parallel
    plan that splits the projections column-wise leaves each rank its own heads."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        hd = config.head_dim
        self.head_dim, self.rope_theta = hd, config.rope_theta
        self.wq = nn.Linear(config.dim, config.n_heads * hd, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * hd, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * hd, bias=False)
        self.wo = nn.Linear(config.n_heads * hd, config.dim, bias=False)

    def qkv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``x [B, n, dim]`` -> rotated ``q [B, n, Hq, hd]``, ``k [B, n, Hkv, hd]`` and ``v``."""
        b, n, _ = x.shape
        q = self.wq(x).view(b, n, -1, self.head_dim)  # [B, n, Hq, hd]
        k = self.wk(x).view(b, n, -1, self.head_dim)  # [B, n, Hkv, hd]
        v = self.wv(x).view(b, n, -1, self.head_dim)
        return apply_rotary(q, positions, self.rope_theta), apply_rotary(k, positions, self.rope_theta), v

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attn: AttnFn, segment: Callable) -> torch.Tensor:
        """``x [B, n, dim]`` -> ``[B, n, dim]``; ``segment(fn, *args)`` runs the projections (checkpointing)."""
        q, k, v = segment(self.qkv, x, positions)
        out = attn(q, k, v)  # [B, n, Hq, hd]: never inside a checkpoint segment of its own
        return self.wo(out.flatten(2))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``; ``[B, n, dim]`` -> ``[B, n, dim]``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.w2 = nn.Linear(config.ffn_dim, config.dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attention(attention_norm(x))``, ``out = h + feed_forward(ffn_norm(h))``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def mlp_residual(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.feed_forward(self.ffn_norm(h))

    def layer(self, x: torch.Tensor, positions: torch.Tensor, attn: AttnFn, segment: Callable) -> torch.Tensor:
        h = x + self.attention(segment(self.attention_norm, x), positions, attn, segment)
        return segment(self.mlp_residual, h)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attn: AttnFn,
                checkpointing: str = "none") -> torch.Tensor:
        """``x [B, n, dim]`` -> ``[B, n, dim]`` under ``checkpointing`` (see :mod:`.checkpointing`)."""
        whole, segment = segment_runner(checkpointing)
        return whole(self.layer, x, positions, attn, segment)


class Llama(nn.Module):
    """``Llama(config, attn=None, checkpointing="none")``.

    Args:
        config: the model's shape.
        attn: the attention callable ``(q, k, v) -> out`` (default ``AttnCall()``: burst over the
            default group); a forward may pass another one.
        checkpointing: ``"none"``, ``"full"`` or ``"remat"`` (see :mod:`burstattn.models.checkpointing`).
    """

    def __init__(self, config: LlamaConfig, attn: Optional[AttnFn] = None, checkpointing: str = "none") -> None:
        super().__init__()
        check_checkpointing(checkpointing)
        self.config, self.checkpointing = config, checkpointing
        self.attn = attn if attn is not None else AttnCall()
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.init_weights()

    def init_weights(self, generator: Optional[torch.Generator] = None) -> None:
        """Normal(0, ``init_std``) linear and embedding weights, ones for the norms (``generator``
        makes it independent of the global RNG)."""
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, (nn.Linear, nn.Embedding)):
                    if module is self.output and self.config.tie_embeddings:
                        continue
                    module.weight.normal_(0.0, self.config.init_std, generator=generator)
                elif isinstance(module, RMSNorm):
                    module.reset_parameters()

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, *, attn: Optional[AttnFn] = None) -> torch.Tensor:
        """``tokens [B, n]`` at global ``positions [n]`` -> logits ``[B, n, vocab_size]``."""
        attn = attn if attn is not None else self.attn
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, positions, attn, self.checkpointing)
        return self.output(self.norm(h))

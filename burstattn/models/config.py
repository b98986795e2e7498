"""LLaMA-style model configurations and the named presets shared by training, inference and the
simulator (one table: ``burstattn.models.PRESETS``)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from types import MappingProxyType
from typing import Any, Mapping, Optional


CHUNK_FIELDS = ("mlp_chunk", "loss_chunk")


def check_chunk(name: str, value: Any) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is a non-negative int (tokens per
    chunk; 0 means the whole local sequence)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be a non-negative int (tokens per chunk, 0: the whole local sequence), "
                         f"got {value!r}")


@dataclass(frozen=True)
class LlamaConfig:
    """The shape of a LLaMA-family decoder (pre-norm, RMSNorm, rotary embeddings, SwiGLU, GQA)."""

    vocab_size: int = 256
    """Number of token ids (256 for the byte-level tokenizer of the synthetic and text data)."""
    dim: int = 64
    """Hidden size (model width); equals ``n_heads * head_dim``."""
    n_layers: int = 2
    """Number of transformer blocks."""
    n_heads: int = 4
    """Query heads per attention layer."""
    n_kv_heads: int = 2
    """Key/value heads (GQA when fewer than ``n_heads``; must divide it)."""
    ffn_dim: int = 128
    """Inner size of the SwiGLU MLP (``w1``/``w3``: dim -> ffn_dim, ``w2``: ffn_dim -> dim)."""
    norm_eps: float = 1e-5
    """Epsilon of RMSNorm."""
    rope_theta: float = 10000.0
    """Base of the rotary embedding frequencies."""
    max_seq_len: int = 131072
    """Longest global sequence the model is meant for (documentation; rotary tables are computed
    from positions on the fly, so this is not a hard limit)."""
    tie_embeddings: bool = False
    """Share the token embedding matrix with the output head."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of linear and embedding weights."""
    mlp_chunk: int = 0
    """Blockwise MLP: tokens per chunk of the local sequence for the SwiGLU MLP with its norm and
    residual, each chunk recomputed in the backward, so at most one chunk's ``[chunk, ffn_dim]``
    intermediates are alive (0: the whole local sequence at once). Changes memory, not the result."""
    loss_chunk: int = 0
    """Blockwise loss: tokens per chunk of the fused final norm + output projection + cross-entropy,
    recomputed in the backward, so ``[n, vocab_size]`` logits never exist (0: whole logits at once).
    Used when the model is called with labels; changes memory, not the result."""
    fused_loss: bool = False
    """The fused loss (:mod:`.fused_loss`): each loss chunk's gradients (the head's input rows and the
    output weight, a float32 ``vocab x dim`` accumulator) computed in the forward, nothing recomputed
    in the backward. Changes time and memory, not the result."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in CHUNK_FIELDS:
                check_chunk(f"LlamaConfig.{f.name}", value)
            elif f.type == "bool" and not isinstance(value, bool):
                raise ValueError(f"LlamaConfig.{f.name} must be a bool, got {value!r}")
            elif f.type in ("int",) and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"LlamaConfig.{f.name} must be a positive int, got {value!r}")
        if self.dim % self.n_heads:
            raise ValueError(f"LlamaConfig: dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"LlamaConfig: n_heads ({self.n_heads}) must be divisible by n_kv_heads "
                             f"({self.n_kv_heads})")
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"LlamaConfig: head_dim ({self.dim // self.n_heads}) must be even for rotary "
                             "embeddings")

    @property
    def head_dim(self) -> int:
        """``dim // n_heads``."""
        return self.dim // self.n_heads

    def num_params(self) -> int:
        """Exact parameter count of :class:`~burstattn.models.Llama` built from this config."""
        d, hd = self.dim, self.head_dim
        attn = d * self.n_heads * hd * 2 + d * self.n_kv_heads * hd * 2  # wq, wo, wk, wv
        mlp = 3 * d * self.ffn_dim
        block = attn + mlp + 2 * d  # two RMSNorm weights
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.n_layers * block + d + head  # + final norm

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (for ``config.json`` beside saved weights)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "LlamaConfig":
        """Inverse of :meth:`to_dict`; unknown keys raise ``ValueError`` naming them."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"LlamaConfig: unknown field(s) {unknown}; known: {sorted(known)}")
        return cls(**dict(values))

    def with_overrides(self, **overrides: Any) -> "LlamaConfig":
        """A copy with some fields replaced (validated again)."""
        return replace(self, **overrides)


@dataclass(frozen=True)
class HybridConfig(LlamaConfig):
    """A hybrid decoder (Qwen3-Next's pattern): Gated DeltaNet layers, every ``full_attention_interval``-th
    layer a full-attention one (:class:`burstattn.models.hybrid.HybridLlama`)."""

    full_attention_interval: int = 4
    """Layer ``i`` is full attention when ``(i + 1) % full_attention_interval == 0``, else Gated DeltaNet."""
    linear_num_key_heads: int = 2
    """Gated DeltaNet query/key heads."""
    linear_num_value_heads: int = 4
    """Gated DeltaNet value heads (a multiple of the key heads)."""
    linear_key_head_dim: int = 16
    """Gated DeltaNet query/key head size."""
    linear_value_head_dim: int = 16
    """Gated DeltaNet value head size."""
    linear_conv_kernel_dim: int = 4
    """Taps of the causal short convolution over q, k, v."""
    linear_chunk: int = 64
    """Tokens per chunk of the chunked delta rule (changes rounding, not the result)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"HybridConfig: linear_num_value_heads ({self.linear_num_value_heads}) must be a "
                             f"multiple of linear_num_key_heads ({self.linear_num_key_heads})")

    def is_attention(self, layer: int) -> bool:
        """Whether layer ``layer`` is a full-attention layer."""
        return (layer + 1) % self.full_attention_interval == 0

    def num_params(self) -> int:
        d, hk, hv = self.dim, self.linear_num_key_heads * self.linear_key_head_dim, \
            self.linear_num_value_heads * self.linear_value_head_dim
        gdn = 2 * d * hk + 3 * d * hv + 2 * d * self.linear_num_value_heads + (2 * hk + hv) * \
            self.linear_conv_kernel_dim + 2 * self.linear_num_value_heads + self.linear_value_head_dim
        attn = d * self.n_heads * self.head_dim * 2 + d * self.n_kv_heads * self.head_dim * 2
        n_attn = sum(self.is_attention(i) for i in range(self.n_layers))
        return super().num_params() - (self.n_layers - n_attn) * (attn - gdn)


def hybrid_tp_problem(config: LlamaConfig, strategy: str, tp: int = 1) -> Optional[str]:
    """Why a model with Gated DeltaNet layers cannot run ``strategy`` at tensor-parallel degree ``tp``
    (``None``: it can, or ``config`` has no such layers; :func:`recurrent_tp_problem`)."""
    return recurrent_tp_problem(strategy, tp) if isinstance(config, HybridConfig) else None


def recurrent_tp_problem(strategy: str, tp: int = 1) -> Optional[str]:
    """Why Gated DeltaNet layers cannot run ``strategy`` at tensor-parallel degree ``tp`` (``None``: they
    can): tensor parallelism (``tp``, ``tp-v1``, ``tp-v3``, or any strategy with ``tp > 1``) splits the
    attention projections, which the recurrent layers' plans do not."""
    if str(strategy).startswith("tp"):
        what = f"strategy {strategy!r}"
    elif tp > 1:
        what = f"tensor parallelism (--tp {tp})"
    else:
        return None
    return (f"hybrid models: {what} is not supported for Gated DeltaNet layers (tensor parallelism splits "
            "attention projections); use a context-parallel strategy (--cp)")


PRESETS: Mapping[str, LlamaConfig] = MappingProxyType({
    # tests: a few thousand parameters, GQA 4/2, exercises every code path quickly
    "tiny": LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128),
    # benchmarks on this 2-core machine: attention-dominated at a few thousand tokens
    "small": LlamaConfig(vocab_size=256, dim=256, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=688),
    # llama3-8b scaled down so that its memory terms weigh as in the real model: GQA 4/1 (8b: 32/8),
    # ffn_dim = 3.5 dim (8b: 14336 / 4096), a vocabulary 32 x dim (8b: 128256 / 4096 = 31), rope 500000
    "small-l3": LlamaConfig(vocab_size=8192, dim=256, n_layers=4, n_heads=4, n_kv_heads=1, ffn_dim=896,
                            rope_theta=500000.0),
    # LLaMA-1 7B / 13B (Touvron et al. 2023, Table 2): MHA, vocab 32000
    "llama-7b": LlamaConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                            ffn_dim=11008, norm_eps=1e-6),
    "llama-13b": LlamaConfig(vocab_size=32000, dim=5120, n_layers=40, n_heads=40, n_kv_heads=40,
                             ffn_dim=13824, norm_eps=1e-6),
    # Llama 3 8B (Meta's model card / params.json): GQA 32/8, vocab 128256, rope 500000
    "llama3-8b": LlamaConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                             ffn_dim=14336, rope_theta=500000.0),
    # Llama 2 70B (params.json): GQA 64/8
    "llama-70b": LlamaConfig(vocab_size=32000, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                             ffn_dim=28672),
    # Llama 3.1 405B (params.json): GQA 128/8
    "llama3-405b": LlamaConfig(vocab_size=128256, dim=16384, n_layers=126, n_heads=128, n_kv_heads=8,
                               ffn_dim=53248, rope_theta=500000.0),
    # hybrids, 3 Gated DeltaNet layers to 1 attention layer (Qwen3-Next's pattern); "-tiny" for tests
    "hybrid-tiny": HybridConfig(vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128),
    "hybrid-small": HybridConfig(vocab_size=256, dim=256, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=688,
                                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                                 linear_value_head_dim=64),
})


def preset(name: str) -> LlamaConfig:
    """The named preset (``ValueError`` naming the known ones otherwise)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
    return PRESETS[name]

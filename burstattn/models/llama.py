"""A LLaMA-family decoder whose attention is any distributed strategy of :func:`burstattn.attention`.

Module names follow torchtitan / Meta's reference implementation (``tok_embeddings``,
``layers[i].attention.wq``, ``feed_forward.w1`` ...), so tensor-parallel plans and weight maps
read the same. Every forward takes the GLOBAL positions of the tokens it holds: a rank holding a
sequence shard passes ``burstattn.sequence_positions(...)`` for its layout, and rotary embeddings
and the causal mask then match the unsharded model exactly.

Shapes: ``tokens [B, n]`` (int64, this rank's shard of a global sequence of N tokens),
``positions [n]`` (int64), hidden states ``[B, n, dim]``, logits ``[B, n, vocab_size]``.

The blockwise transformer: the MLP runs over chunks of ``config.mlp_chunk`` tokens and, given
labels, the final norm + output projection + cross-entropy over chunks of ``config.loss_chunk``
tokens, each chunk recomputed in the backward (:mod:`.blockwise`); ``checkpointing`` and
``offload`` say what is kept between forward and backward and where (:mod:`.checkpointing`,
:mod:`.offload`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..strategies import attention as distributed_attention
from .blockwise import blockwise_cross_entropy, blockwise_rows, merge_shards
from .checkpointing import LayerRun, check_checkpointing, checkpointed
from .config import LlamaConfig
from .fused_loss import fused_cross_entropy
from .head_chunks import head_chunked_attention
from .norms import RMSNorm
from .offload import HostOffload, check_offload
from .rope import apply_rotary

AttnFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
OP_STRATEGIES = ("burst", "ring")  # strategies that run as torch.ops.burstattn.attention_fwd


@dataclass(frozen=True)
class AttnCall:
    """The causal distributed attention a model calls: ``(q [B, n, Hq, D], k, v [B, n, Hkv, D]) ->
    [B, n, Hq, D]`` through ``burstattn.attention(strategy=..., group=..., layout=..., **options)``.

    ``group`` is the context-parallel group (``None``: the default group, or one process).
    ``layout`` must be the layout the tokens were sharded with. ``head_chunks``: run the call over
    that many groups of heads, one after another (:mod:`burstattn.models.head_chunks`)."""

    strategy: str = "burst"
    group: Optional[dist.ProcessGroup] = None
    layout: Optional[str] = None
    options: dict = field(default_factory=dict)
    head_chunks: int = 1

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        layout = self.layout
        if layout in (None, "zigzag", "striped") and (not dist.is_initialized() or dist.get_world_size(self.group) == 1):
            layout = "contiguous"  # one process: every layout is the sequence in order, any length (an odd one too)
        if self.head_chunks != 1:
            return head_chunked_attention(q, k, v, chunks=self.head_chunks, strategy=self.strategy, group=self.group,
                                          causal=True, layout=layout, **self.options)
        return distributed_attention(q, k, v, strategy=self.strategy, group=self.group, causal=True,
                                     layout=layout, **self.options)

    @property
    def through_op(self) -> bool:
        """Whether the call runs as the registered op ``torch.ops.burstattn.attention_fwd`` (burst and
        ring without a ``mask_mod``), which ``remat`` can checkpoint keeping only its outputs."""
        mask = self.options.get("mask")
        python_mask = self.options.get("mask_mod") is not None or getattr(mask, "mask_mod", None) is not None
        return self.strategy in OP_STRATEGIES and not python_mask


class LossOutput(NamedTuple):
    """What ``Llama(tokens, positions, labels=..., total_targets=...)`` returns (a pytree, so FSDP's
    hooks see the loss): ``loss`` this rank's share ``sum(CE of its targets) / total_targets``
    (float32 scalar); ``answer_hits`` and ``answer_ce`` (float64, detached): argmax hits and
    cross-entropy sum over the ``answer`` positions; ``host_bytes``: bytes of saved activations this
    forward copied to host memory (``offload``)."""

    loss: torch.Tensor
    answer_hits: torch.Tensor
    answer_ce: torch.Tensor
    host_bytes: int = 0


class Attention(nn.Module):
    """Grouped-query attention: ``wq`` (dim -> Hq*hd), ``wk``/``wv`` (dim -> Hkv*hd), ``wo`` (Hq*hd -> dim).

    ``forward`` stops before the output projection ``wo`` (the block applies it chunk by chunk
    with the MLP). Head counts are read from the projection outputs (``-1`` in the views), so a
    tensor-parallel plan that splits the projections column-wise leaves each rank its own heads."""

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

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attn: Optional[AttnFn]):
        """``x [B, n, dim]`` (normed) -> the attention output ``[B, n, Hq, hd]`` (before ``wo``), or,
        with ``attn=None``, the rotated ``(q, k, v)``."""
        q, k, v = self.qkv(x, positions)
        return (q, k, v) if attn is None else attn(q, k, v)


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``; ``[B, n, dim]`` -> ``[B, n, dim]``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.w2 = nn.Linear(config.ffn_dim, config.dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + wo(attention(attention_norm(x)))``, ``out = h + feed_forward(ffn_norm(h))``.

    The second half (``wo``, the residual, the norm and the MLP) runs over chunks of the local
    rows (``LayerRun.mlp_chunk``); under Megatron-V3 the attention output has ``tp`` times the
    block's rows and each chunk takes its rows of it (:func:`~burstattn.models.blockwise.row_chunks`)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def attend(self, x: torch.Tensor, positions: torch.Tensor, attn: Optional[AttnFn]):
        """``x [B, m, dim]`` -> attention output ``[B, n, Hq, hd]`` (or ``(q, k, v)`` when ``attn`` is None)."""
        return self.attention(self.attention_norm(x), positions, attn)

    def finish(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """One chunk of local rows: ``x [B, c, dim]`` and their rows of the attention output
        ``out [B, shards, c, Hq, hd]`` -> ``[B, c, dim]``."""
        rows = merge_shards(out)  # [B, shards * c, Hq, hd]
        h = x + self.attention.wo(rows.flatten(2))
        return h + self.feed_forward(self.ffn_norm(h))

    def layer(self, x: torch.Tensor, positions: torch.Tensor, attn: AttnFn, run: LayerRun) -> torch.Tensor:
        if run.checkpointing != "remat":
            out = self.attend(x, positions, attn)
        elif run.through_op:
            out = run.attention_segment(self.attend, x, positions, attn)
        else:  # the norm and projections recomputed; the attention keeps what its own backward saves
            q, k, v = checkpointed(self.attend, x, positions, None)
            out = attn(q, k, v)
        shards = out.shape[1] // x.shape[1]
        return blockwise_rows(self.finish, x, out, chunk=run.mlp_chunk, recompute=run.mlp_recomputed, shards=shards)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attn: AttnFn, run: LayerRun = LayerRun()) -> torch.Tensor:
        """``x [B, m, dim]`` -> ``[B, m, dim]`` run as ``run`` says (see :mod:`.checkpointing`)."""
        return run.whole_layer(self.layer, x, positions, attn, run)


class Llama(nn.Module):
    """``Llama(config, attn=None, checkpointing="none", offload="none")``.

    Args:
        config: the model's shape, and its ``mlp_chunk`` / ``loss_chunk`` (0: whole).
        attn: the attention callable ``(q, k, v) -> out`` (default ``AttnCall()``: burst over the
            default group); a forward may pass another one.
        checkpointing: ``"none"``, ``"full"`` or ``"remat"`` (see :mod:`burstattn.models.checkpointing`).
        offload: ``"none"``, ``"inputs"`` or ``"all"``: saved activations kept in host memory between
            forward and backward (see :mod:`burstattn.models.offload`; a no-op on CPU).

    Raises:
        ValueError: an unknown checkpointing or offload mode.
    """

    def __init__(self, config: LlamaConfig, attn: Optional[AttnFn] = None, checkpointing: str = "none",
                 offload: str = "none") -> None:
        super().__init__()
        check_checkpointing(checkpointing)
        check_offload(offload)
        self.config, self.checkpointing, self.offload = config, checkpointing, offload
        self.offload_copies_on_cpu = False  # tests: make the CPU offload copy, to exercise it
        self.offload_host = None  # the dry run: where its CPU (fake) tensors' host copies go (HostOffload.host)
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

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and output projection: ``h [B, c, dim]`` -> logits ``[B, c', vocab_size]``."""
        return self.output(self.norm(h))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, *, attn: Optional[AttnFn] = None,
                labels: Optional[torch.Tensor] = None, total_targets: Optional[int] = None,
                answer: Optional[torch.Tensor] = None):
        """``tokens [B, n]`` at global ``positions [n]`` -> logits ``[B, n, vocab_size]``; with
        ``labels [B, n]`` (``IGNORE_INDEX``: no target) and ``total_targets`` (the targets of the global
        batch) -> :class:`LossOutput`, the cross-entropy computed blockwise (``config.loss_chunk``),
        so the logits of the whole sequence never exist. ``answer [B, n]`` (bool): positions whose
        argmax hits and cross-entropy are counted.

        Raises:
            ValueError: ``labels`` without ``total_targets`` or of another shape than ``tokens``.
        """
        attn = attn if attn is not None else self.attn
        if labels is not None and (total_targets is None or tuple(labels.shape) != tuple(tokens.shape)):
            raise ValueError(f"Llama.forward: labels {tuple(labels.shape)} must match tokens {tuple(tokens.shape)} "
                             f"and come with total_targets (got {total_targets!r})")
        training = torch.is_grad_enabled()
        off = HostOffload(self.offload if training else "none", copy_on_cpu=self.offload_copies_on_cpu,
                          host=self.offload_host)
        run = LayerRun(self.checkpointing if training else "none", self.config.mlp_chunk,
                       bool(getattr(attn, "through_op", False)), off if off.active else None)
        with off.hooks():
            h = self.tok_embeddings(tokens)
            for layer in self.layers:
                h = layer(off.mark(h), positions, attn, run)
            if labels is None:
                return self.head(h)
            shards = tokens.shape[1] // h.shape[1]  # Megatron-V3: the residual stream is a 1/tp shard
            if self.config.fused_loss:  # the gradients computed in the forward (.fused_loss)
                loss, stats = fused_cross_entropy(self.norm, self.output.weight, off.mark(h), labels,
                                                  chunk=self.config.loss_chunk, divisor=total_targets,
                                                  answer=answer, shards=shards)
            else:
                ce, stats = blockwise_cross_entropy(self.head, off.mark(h), labels, chunk=self.config.loss_chunk,
                                                    answer=answer, shards=shards)
                loss = ce / total_targets
        return LossOutput(loss, stats[0], stats[1], off.bytes_on_host)

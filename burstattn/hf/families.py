"""The model families of today under ``attn_implementation="burst"``: what each attention call asks
beyond plain causal attention, mapped onto burstattn's arguments, and a clear refusal for what
cannot be honoured.

transformers hands the attention function its modifiers as keyword arguments (checked in 5.23 /
5.24 by running each family's eager attention):

* Gemma 2 (and T5Gemma): ``softcap`` (logit softcapping) and ``sliding_window`` on alternating
  layers;
* gpt-oss: ``s_aux``, the learned per-head sink logit (an ``nn.Parameter [Hq]``; our op gives it its
  gradient), and ``sliding_window`` on alternating layers;
* DeepSeek-V3's MLA: ``value`` has a head size of its own (``v_head_dim != qk_head_dim``), which the
  engine carries as is (K and V at their own sizes);
* encoder-decoder models (T5Gemma): bidirectional encoder self-attention (``module.is_causal`` is
  False; HF's bidirectional window is ``|i - j| <= sliding_window``), and cross-attention
  (``*CrossAttention`` modules: queries of the decoder against the encoder's keys, a sequence of
  its own length sharded with the same layout).

HF's causal ``sliding_window`` w sees ``i - j < w``: burstattn's window ``(w - 1, 0)``.

:func:`describe` is the one place that reads these; :func:`check_model` refuses a model whose
attention never reaches the registered function (transformers then silently runs its own attention
on each rank's shard alone).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

# keyword arguments transformers passes that change nothing about the scores (positions are in the
# RoPE already; packing metadata is handled by the caller; the rest are flags of other layers)
PASSIVE = frozenset({"position_ids", "use_cache", "output_attentions", "output_router_logits", "cache_position",
                     "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "output_hidden_states",
                     "return_dict", "past_key_values", "cache", "token_type_ids", "kwargs",
                     # the loss's arguments, which models pass down with every other forward keyword
                     "num_items_in_batch", "shift_labels", "logits_to_keep",
                     "burst_shard"})  # burstattn.hf.shard_batch's ShardSpec, read by the attention function
APPLIED = frozenset({"softcap", "s_aux", "sliding_window", "is_causal"})
TESTED = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gpt_oss", "deepseek_v3", "t5gemma")

Problem = Optional[tuple[type, str]]


@dataclass(frozen=True)
class CallSpec:
    """What one attention call of a model asks for, in burstattn's terms.

    Attributes:
        causal: the layer's own flag (decoder self-attention); False for encoders and cross-attention.
        cross: the keys come from another sequence (an encoder's), of its own length.
        window: ``(left, right)`` or ``None``; softcap: ``None`` or the cap; sinks: ``[Hq]`` or ``None``.
    """

    causal: bool = True
    cross: bool = False
    window: Optional[tuple] = None
    softcap: Optional[float] = None
    sinks: Optional[torch.Tensor] = None

    def options(self) -> dict:
        """The keyword arguments of :func:`burstattn.attention` beyond ``causal`` (only the set ones)."""
        out: dict[str, Any] = {}
        if self.window is not None:
            out["window"] = self.window
        if self.softcap is not None:
            out["softcap"] = self.softcap
        if self.sinks is not None:
            out["sinks"] = self.sinks
        return out


def is_cross_attention(module) -> bool:
    """Whether ``module`` attends to another sequence (an encoder's): a ``*CrossAttention`` class or an
    ``is_cross_attention`` flag."""
    return bool(getattr(module, "is_cross_attention", False)) or type(module).__name__.endswith("CrossAttention")


def _family(module) -> str:
    config = getattr(module, "config", None)
    return getattr(config, "model_type", None) or type(module).__name__


def describe(module, query: torch.Tensor, key: torch.Tensor, kwargs: dict) -> tuple[CallSpec, Problem]:
    """The :class:`CallSpec` of one call of the attention function (``query [B, Hq, S, D]``,
    ``key [B, Hkv, S_kv, D]`` as transformers gives them), and the problem that prevents it, if any: a
    keyword argument that changes the scores in a way burstattn does not know (never ignored)."""
    unknown = sorted(n for n, v in kwargs.items() if n not in PASSIVE | APPLIED and v is not None)
    problem: Problem = None
    if unknown:
        problem = ValueError, (f"attn_implementation='burst': model type {_family(module)!r} passes {unknown} to its "
                               f"attention, which burstattn does not know how to apply (it would be dropped); the "
                               f"families it is tested with: {list(TESTED)}")
    cross = is_cross_attention(module)
    causal = False if cross else bool(kwargs.get("is_causal", getattr(module, "is_causal", True)))
    sw = kwargs["sliding_window"] if "sliding_window" in kwargs else getattr(module, "sliding_window", None)
    window = None
    if sw is not None and not cross:
        sw = int(sw)
        window = (sw - 1, 0) if causal else (sw, sw)  # HF: causal i - j < w; bidirectional |i - j| <= w
    softcap = kwargs.get("softcap")
    softcap = None if softcap is None or float(softcap) == 0.0 else float(softcap)
    sinks = kwargs.get("s_aux")
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (query.shape[1],)):
        problem = problem or (ValueError, f"attn_implementation='burst': s_aux (attention sinks) must be a tensor "
                                          f"[{query.shape[1]}] (one logit per query head), got "
                                          f"{tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks)}")
        sinks = None
    return CallSpec(causal=causal, cross=cross, window=window, softcap=softcap, sinks=sinks), problem


def check_model(model) -> None:
    """Raise ``ValueError`` if ``model`` cannot run under ``attn_implementation="burst"``.

    Models whose classes do not dispatch attention through transformers' ``AttentionInterface``
    (``_supports_attention_backend = False``: T5, BART, BLOOM, MPT, Falcon, ... in transformers 5.x)
    accept any registered name and then run their own attention: under sequence parallelism each
    rank would attend within its own shard only, a silently wrong result. :class:`ContextParallelTrainer`
    calls it when it is built and :func:`~burstattn.hf.sync_gradients` before its first collective, so a
    training step never gets past the backward with such a model; call it yourself after building the
    model for other uses (every rank). Families that do dispatch are checked call by call
    (:func:`describe`)."""
    cls = type(model)
    if not getattr(cls, "_supports_attention_backend", False):
        family = getattr(getattr(model, "config", None), "model_type", cls.__name__)
        raise ValueError(f"burstattn.hf: model type {family!r} ({cls.__name__}) does not dispatch its attention "
                         f"through transformers' AttentionInterface, so attn_implementation='burst' would be "
                         f"ignored and every rank would attend within its own shard only; families that work: "
                         f"{list(TESTED)} (and others that dispatch through the interface)")

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

import sys
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch

from .hybrid_mixers import hint
from .survey import survey

# keyword arguments transformers passes that change nothing about the scores (positions are in the
# RoPE already; packing metadata is handled by the caller; the rest are flags of other layers)
PASSIVE = frozenset({"position_ids", "use_cache", "output_attentions", "output_router_logits", "cache_position",
                     "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "output_hidden_states",
                     "return_dict", "past_key_values", "cache", "token_type_ids", "kwargs",
                     # the loss's arguments, which models pass down with every other forward keyword
                     "num_items_in_batch", "shift_labels", "logits_to_keep",
                     "burst_shard"})  # burstattn.hf.shard_batch's ShardSpec, read by the attention function
APPLIED = frozenset({"softcap", "s_aux", "sliding_window", "is_causal"})
SUPPORTED_KEY = "_burstattn_supported_mixers"  # on a model: the supported_mixers check_model accepted
TESTED = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gpt_oss", "deepseek_v3", "falcon", "t5gemma")

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


def kv_source_layer(module) -> int:
    """The cache layer holding the K/V that attention ``module`` attends to: its own ``layer_idx``, or for a
    layer that reuses earlier keys and values (Gemma 4's KV-shared layers, ``is_kv_shared_layer``) the layer
    that stores them: the last earlier one of its type marked ``"store"`` in ``config.kv_sharing_modes``."""
    idx = module.layer_idx
    if not getattr(module, "is_kv_shared_layer", False):
        return idx
    modes, types = module.config.kv_sharing_modes, module.config.layer_types
    return next((j for j in range(idx - 1, -1, -1) if modes[j] == "store" and types[j] == types[idx]), idx)


def registration(name) -> Optional[Any]:
    """The :class:`~burstattn.hf.Registration` registered under ``name`` by :func:`burstattn.hf.register`,
    or ``None`` (not registered, or a function of transformers' own such as ``"sdpa"``)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if not isinstance(name, str):
        return None
    return getattr(ALL_ATTENTION_FUNCTIONS.get(name), "burst_registration", None)


def _configs(model, attention: list) -> list:
    """The model's config, its sub-configs and those of its attention modules (each once)."""
    out: dict[int, Any] = {}
    root = getattr(model, "config", None)
    for cfg in [root] + [getattr(root, k, None) for k in getattr(root, "sub_configs", {}) or {}] + \
            [getattr(m, "config", None) for _, m in attention]:
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            out.setdefault(id(cfg), cfg)
    return list(out.values())


def _listed(items: list, most: int = 4) -> str:
    more = f" and {len(items) - most} more" if len(items) > most else ""
    return "; ".join(str(x) for x in items[:most]) + more


def model_problem(model, supported_mixers: Iterable = (), *, implementation: bool = True,
                  router: bool = True) -> Optional[str]:
    """Why ``model`` cannot run sequence parallel under burstattn (``None``: it can); see :func:`check_model`.
    ``implementation``: also require every attention module's ``config._attn_implementation`` to be a
    burstattn registration; ``router``: also refuse ``output_router_logits``."""
    cls = type(model)
    family = getattr(getattr(model, "config", None), "model_type", None) or cls.__name__
    found = survey(model, supported_mixers)
    if not found.attention:
        return (f"burstattn.hf: model type {family!r} ({cls.__name__}) does not dispatch its attention through "
                f"transformers' AttentionInterface, so attn_implementation='burst' would be ignored and every rank "
                f"would attend within its own shard only; families that work: {list(TESTED)} (and others that "
                f"dispatch through the interface)")
    if found.mixers:
        return (f"burstattn.hf: model type {family!r} ({cls.__name__}) mixes the sequence outside the attention "
                f"that reaches burstattn: {_listed(found.mixers)}. Under sequence parallelism each rank would run "
                f"these layers on its own shard of the tokens only (a silently wrong loss and gradients); burstattn "
                f"supports models whose layers mix tokens only through attention dispatched through transformers' "
                f"AttentionInterface (convolutions, SSM / Mamba, linear attention and recurrences are refused)"
                + "".join(f"; {h}" for h in dict.fromkeys(hint(m.cls) for m in found.mixers) if h))
    if any(getattr(cfg, "alibi", False) is True for cfg in _configs(model, found.attention)):
        return (f"burstattn.hf: model type {family!r} ({cls.__name__}) has alibi=True: it adds its ALiBi bias to "
                f"the attention mask it builds over the whole sequence, which burstattn's sharded attention does not "
                f"take (each rank would need its own rows and columns of it); burstattn applies ALiBi itself "
                f"(burst_attn_func(..., alibi_slopes=...)), not through a model's mask")
    if implementation:
        bad: dict[str, str] = {}
        for path, module in found.attention:
            impl = getattr(getattr(module, "config", None), "_attn_implementation", None)
            if registration(impl) is None:
                bad.setdefault(str(impl), path)
        if bad:
            where = ", ".join(f"{impl!r} (at {path})" for impl, path in bad.items())
            return (f"burstattn.hf: model type {family!r} ({cls.__name__}) runs attention implementation {where}, "
                    f"not one registered with burstattn.hf.register: under sequence parallelism every rank would "
                    f"attend within its own shard only. Register first, then build the model with "
                    f"attn_implementation='burst' (from_pretrained(DIR, attn_implementation='burst')) or call "
                    f"model.set_attn_implementation('burst')")
    if router:
        routed = [cfg for cfg in _configs(model, found.attention) if getattr(cfg, "output_router_logits", False)]
        if routed:
            return (f"burstattn.hf: model type {family!r} ({cls.__name__}) has output_router_logits=True: the "
                    f"router's auxiliary (load-balancing) loss is a product of means over the tokens, which each "
                    f"rank would compute over its own shard (a wrong loss and gradients); set "
                    f"model.config.output_router_logits = False")
    return None


def check_model(model, *, supported_mixers: Iterable = ()) -> None:
    """Raise ``ValueError`` if ``model`` cannot run sequence parallel under a burstattn ``attn_implementation``.

    Decided from what the model contains (:func:`burstattn.hf.survey.survey`), call it on every rank once
    the model is built with the registered implementation:

    * no module dispatches through transformers' ``ALL_ATTENTION_FUNCTIONS`` (T5, BART, BLOOM, MPT, ... in
      transformers 5.x; Falcon before 5.25): the registered name would be ignored;
    * a module mixes the sequence outside that attention (:func:`burstattn.hf.survey.sequence_mixers`:
      convolutions, SSM / Mamba, linear attention, recurrences, or a module the survey cannot classify,
      named by its class): it would run on each rank's shard alone. ``supported_mixers``: classes (or
      class names) accepted as a whole (a later table of sequence-parallel mixers);
    * an attention module's ``config._attn_implementation`` (the model's, or a sub-config's) is not a
      function registered with :func:`burstattn.hf.register` (``from_pretrained(DIR)`` keeps ``"sdpa"``);
    * ``output_router_logits=True`` in a config (the MoE auxiliary loss is not additive over shards);
    * ``alibi=True`` in a config (Falcon's ALiBi: a bias added to the model's own whole-sequence mask).

    :class:`ContextParallelTrainer` calls it when it is built, :func:`~burstattn.hf.sync_gradients` before
    its first collective, and the attention and mask functions at the first forward of a model (the same
    survey, read from the running model), so every rank raises the same message before a wrong step."""
    supported = tuple(supported_mixers)
    problem = model_problem(model, supported)
    if problem:
        raise ValueError(problem)
    if supported:  # the forward's own check (burstattn.hf.guard) accepts what this call accepted
        model.__dict__[SUPPORTED_KEY] = supported


def __getattr__(name: str):
    # names that moved out of this module (the table burstattn.MOVED): resolved, or refused with the new spelling
    return sys.modules["burstattn"].moved_attribute(__name__, name)

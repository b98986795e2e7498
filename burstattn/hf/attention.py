"""``attn_implementation="burst"``: burstattn's distributed attention inside transformers models.

:func:`register` adds two functions to transformers' global registries under one name:

* an attention function (``AttentionInterface``) with transformers' signature
  ``fn(module, query [B, Hq, S, D], key [B, Hkv, S_kv, D], value, attention_mask, dropout, scaling,
  **kwargs) -> (out [B, S, Hq, D], None)``;
* its mask function (``AttentionMaskInterface``). Without one, transformers builds no mask for a
  custom implementation and silently drops a padding ``attention_mask``. Ours returns a
  :class:`BurstMask` (or ``None``). A 2-D padding ``attention_mask`` handed straight to the model's
  forward is REFUSED on every rank (one cross-rank check per forward, :func:`burstattn.comm.agree.agree`): pass it to
  :func:`burstattn.hf.shard_batch`, which turns padding into a document mask. Under generation over a
  :class:`burstattn.hf.ShardedCache` padding is honoured as a key mask.

Three ways a model runs under it:

* a :func:`burstattn.hf.shard_batch` batch (training, scoring): its ``burst_shard``
  (:class:`burstattn.hf.ShardSpec`) says where this rank's tokens are and which documents they belong
  to; attention is :func:`burstattn.attention` with the registered ``strategy`` and options, the
  batch's layout and document mask (a sliding window joins it), and what the model family asks for
  (:func:`burstattn.hf.families.describe`: softcap, sinks, bidirectional encoders, cross-attention, a
  V head size of its own).
* a hand-sharded forward without ``burst_shard``: the ``position_ids`` must be this rank's share of the
  registered layout (checked on every rank, so the FULL batch on every rank raises instead of giving a
  plausible wrong loss).
* over a :class:`burstattn.hf.ShardedCache` (generation): every rank runs the same tokens, the cache
  keeps each rank's shard of K/V, and the queries attend to every shard with
  :func:`burstattn.infer.sharded.replicated_attention` (partials merged by LSE).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..call.prepare import label, refuse
from ..comm.agree import agree
from ..comm.groups import group_context
from ..infer.sharded import replicated_attention
from ..layouts.named import layout_or_default, local_positions, split_error
from ..strategies import STRATEGIES, attention
from ..strategies.base import MASK_OPTIONS
from .families import describe, kv_source_layer, registration
from .guard import check_running_model

OPTIONS = ("strategy", "layout", "backend", "group")
MASKED = tuple(sorted(name for name, s in STRATEGIES.items() if "mask" in s.options))  # honour documents


@dataclass(frozen=True)
class Registration:
    """The record of one :func:`register` call, kept on the registered attention function (an
    implementation's settings, not one call's :class:`burstattn.BurstOptions`): ``strategy`` (a
    :data:`burstattn.strategies.STRATEGIES` name), ``layout`` (``None``: chosen per batch by
    :func:`burstattn.hf.shard_batch`), ``backend`` (local kernel), ``group`` (``None``: the default
    group), ``options`` (the strategy's own, e.g. ``ulysses_degree`` / ``ring_degree`` for usp,
    ``backward`` for burst) and ``name`` (the ``attn_implementation``)."""

    strategy: str = "burst"
    layout: Optional[Any] = None
    backend: str = "auto"
    group: Optional[dist.ProcessGroup] = None
    options: dict = field(default_factory=dict)
    name: str = "burst"  # the attn_implementation it is registered under


@dataclass(frozen=True)
class BurstMask:
    """What the mask function hands every layer: ``cache`` is the :class:`ShardedCache` of this
    forward (``None`` for a sequence-parallel forward without one); ``keys`` is the 2-D padding mask
    over the cached positions (bool ``[B, kv_length]``, True = a token), or ``None``."""

    cache: Any = None
    keys: Optional[torch.Tensor] = None
    rows: Optional[slice] = None
    """The query rows a model kept (``None``: all): Gemma 4 slices ``mask[:, :, rows, :]`` to
    ``logits_to_keep`` before its KV-shared layers, which then run only those queries."""

    def __getitem__(self, index) -> "BurstMask":
        rows = index[2] if isinstance(index, tuple) and len(index) > 2 else slice(None)
        if rows in (slice(None), slice(0, None)):  # logits_to_keep=0: every row
            return self
        if not isinstance(rows, slice) or self.rows is not None:
            raise TypeError(f"attn_implementation='burst': the mask's query rows can be sliced once, by a slice; "
                            f"got {index!r}")
        return replace(self, rows=rows)


class ShardedOffset(int):
    """The ``kv_offset`` a :class:`ShardedCache` reports to transformers' mask creation: the plain
    int 0 (transformers uses it as such) that also tells our mask function which cache is in use."""

    cache: Any

    def __new__(cls, value: int, cache: Any) -> "ShardedOffset":
        obj = super().__new__(cls, value)
        obj.cache = cache
        return obj


def _forward_shard(forward_args: Optional[dict]):
    """The ``burst_shard`` the running model's forward was given (``None``: none, or no such forward)."""
    if forward_args is None:
        return None
    return forward_args.get("burst_shard") or (forward_args.get("kwargs") or {}).get("burst_shard")


def _group_of(opts: Registration, shard) -> Optional[dist.ProcessGroup]:
    """The group of this forward: the batch's own (a dynamically dispatched micro-batch), else the registered one."""
    own = getattr(shard, "group", None)
    return opts.group if own is None else own


def make_mask_function(opts: Registration):
    """The ``AttentionMaskInterface`` function: :class:`BurstMask`; ``ValueError`` on every rank if any
    rank's 2-D ``attention_mask`` masks a token in a forward without a :class:`ShardedCache`."""

    def burst_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                   mask_function=None, attention_mask: Optional[torch.Tensor] = None, **kwargs) -> BurstMask:
        forward_args = check_running_model()  # a model that cannot run under burstattn: check_model's message, first
        padded = attention_mask is not None and not bool(attention_mask.all())
        cache = getattr(kv_offset, "cache", None)
        if cache is not None:  # generation: padding is a key mask over the cache
            return BurstMask(cache=cache, keys=attention_mask.bool() if padded else None)
        group = _group_of(opts, _forward_shard(forward_args))  # the ranks that run this forward together
        problem = None if not padded else (
            "the attention_mask masks tokens (padding) in a forward without burstattn.hf.shard_batch; padding "
            "masks are not supported there: pass the FULL batch with its attention_mask to "
            "burstattn.hf.shard_batch(..., attention_mask=mask), which turns padding into a document mask")
        agree("attn_implementation='burst'", (), group_context(group).group, problem=problem)
        return BurstMask()

    return burst_mask


def _local_problem(module, query, key, attention_mask, dropout: float, cross: bool = False):
    if isinstance(attention_mask, BurstMask) and attention_mask.rows is not None:
        return ValueError, (f"attn_implementation='burst': the model kept query rows {attention_mask.rows} "
                            f"(logits_to_keep) in a sequence-parallel forward, where each rank holds a shard of the "
                            f"sequence; pass logits_to_keep=0 and select the logits after burstattn.hf.gather_logits")
    if attention_mask is not None and not isinstance(attention_mask, BurstMask):
        return ValueError, ("attn_implementation='burst' got a prepared 4-D attention mask; custom masks are "
                            "not supported (pass attention_mask=None, or a 2-D padding mask to "
                            "burstattn.hf.shard_batch)")
    if dropout:
        return ValueError, f"attn_implementation='burst' has no attention dropout; got dropout={dropout}"
    if key.shape[2] != query.shape[2] and not cross:
        return ValueError, (f"attn_implementation='burst': {key.shape[2]} keys for {query.shape[2]} queries: a "
                            "cache holds past tokens; generate with burstattn.hf.ShardedCache() as the cache")
    return None


def _same_layout(a, b) -> bool:
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    return a.fingerprint == b.fingerprint


def _shard_problem(opts: Registration, spec, shard, query, rank: int, world: int) -> Optional[str]:
    """Why the ``burst_shard`` of this forward does not fit this rank, layer or registration."""
    if (shard.world_size, shard.rank) != (world, rank):
        return (f"the batch was sharded for rank {shard.rank} of {shard.world_size}, but this is rank {rank} of "
                f"{world} of the registered group")
    if (query.shape[0], query.shape[2]) != (shard.plan.rows, shard.positions.numel()):
        return (f"the batch was sharded as [{shard.plan.rows}, {shard.positions.numel()}] tokens per rank but the "
                f"model got [{query.shape[0]}, {query.shape[2]}]: pass shard_batch's output unchanged")
    if shard.name != opts.name:
        return (f"the batch was sharded for attn_implementation {shard.name!r} (layout {shard.layout!r}) but the model "
                f"runs {opts.name!r} (registered layout={opts.layout!r}): shard it with "
                f"burstattn.hf.shard_batch(..., name={opts.name!r})")
    if opts.layout is not None and not _same_layout(opts.layout, shard.layout):
        return (f"layout mismatch: registered layout={opts.layout!r} but the batch was sharded with "
                f"{shard.layout!r}; shard with burstattn.hf.shard_batch(..., name={opts.name!r}) and its default "
                f"layout=None")
    if shard.cu_seqlens is not None and "mask" not in spec.options:
        return (f"strategy {opts.strategy!r} cannot honour packed documents or padding (a document mask); "
                f"register one of {list(MASKED)}")
    if not isinstance(shard.layout, str) and not spec.partitions:
        return f"strategy {opts.strategy!r} takes layout names, not a document partition"
    return None


def _position_problem(opts: Registration, kwargs: dict, query, rank: int, world: int) -> Optional[str]:
    """Why this hand-sharded forward's ``position_ids`` are not this rank's share of the layout."""
    pos = kwargs.get("position_ids")
    n = query.shape[2]
    layout = layout_or_default(opts.layout)
    hint = ("shard the batch with burstattn.hf.shard_batch (every rank passes the same full batch and gets its "
            "shard); generate with burstattn.hf.ShardedCache()")
    if world > 1 and pos is None:
        return f"a forward at world size {world} without position_ids or burst_shard cannot be checked: {hint}"
    if pos is not None and pos.shape[-1] != n:
        return f"position_ids hold {pos.shape[-1]} positions for {n} tokens: {hint}"
    if world > 1 and split_error(n * world, world, layout):
        return f"{n} tokens on this rank are not a shard of layout {layout!r} over {world} ranks: {hint}"
    expected = local_positions(n * world, rank, world, layout) if world > 1 else torch.arange(n)
    if pos is not None and not bool((pos.to(expected.device) == expected).all()):
        if world == 1:
            return ("position_ids that restart (packed documents) need the document mask: pass the batch "
                    "through burstattn.hf.shard_batch(input_ids, labels, position_ids=...)")
        return (f"this rank's position_ids are not its share of layout {layout!r} over {world} ranks (the full "
                f"batch on every rank, or another layout?): {hint}")
    return None


def _parallel_problem(module, kwargs: dict, forward_args: Optional[dict], shard, world: int):
    """What a sequence-parallel forward (a ``shard_batch`` batch, or any forward at world > 1) cannot
    honour: the MoE router's auxiliary loss, and ``labels`` that transformers would shift inside this
    rank's shard (a hand-sharded forward)."""
    if shard is None and world == 1:
        return None
    if kwargs.get("output_router_logits") or getattr(getattr(module, "config", None), "output_router_logits", False):
        return ValueError, ("attn_implementation='burst': output_router_logits=True in a sequence-parallel forward: "
                            "the router's auxiliary (load-balancing) loss is a product of means over the tokens, "
                            "which each rank would compute over its own shard (a wrong loss and gradients); pass "
                            "output_router_logits=False (and set model.config.output_router_logits = False)")
    labels = None if forward_args is None else forward_args.get("labels")
    model = None if forward_args is None else forward_args.get("self")
    seq2seq = bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))  # no shift in their loss
    if shard is None and labels is not None and kwargs.get("shift_labels") is None and not seq2seq:
        return ValueError, (f"attn_implementation='burst': labels in a hand-sharded forward at world size {world}: "
                            "transformers would shift them inside this rank's shard (a wrong loss); pass the FULL "
                            "batch through burstattn.hf.shard_batch(input_ids, labels) (labels shifted on the global "
                            "sequence, the global num_items_in_batch), or give shift_labels= (this rank's share of "
                            "the globally shifted labels) yourself")
    return None


def make_attention_function(opts: Registration):
    """The ``AttentionInterface`` function for ``opts`` (see the module docstring)."""
    spec = STRATEGIES[opts.strategy]

    def burst_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask=None, dropout: float = 0.0, scaling: Optional[float] = None,
                        **kwargs) -> tuple[torch.Tensor, None]:
        cache = attention_mask.cache if isinstance(attention_mask, BurstMask) else None
        # check_model's message first, on every path; the frame walk (~0.1 ms) once per batch / cache
        # (the model's first burst layer), every layer only for a hand-sharded forward
        given = kwargs.get("burst_shard")
        seen = cache.__dict__.get("_burstattn_guarded") if cache is not None else given is not None and given.attended
        forward_args = None if seen else check_running_model()
        if cache is not None:
            cache.__dict__["_burstattn_guarded"] = True
        call, family_problem = describe(module, query, key, kwargs)
        window = call.window
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        # [B, H, S, D] -> [B, S, H, D]: burstattn's layout; under autocast RoPE can leave q/k in float32
        # next to a 16-bit v: one dtype, autocast's (as SDPA does), else the query's
        dtype = query.dtype
        if len({query.dtype, key.dtype, value.dtype}) > 1 and torch.is_autocast_enabled(query.device.type):
            dtype = torch.get_autocast_dtype(query.device.type)
        q, k, v = (x.transpose(1, 2).to(dtype) for x in (query, key, value))
        if cache is not None and not call.cross:
            if dropout:
                raise ValueError(f"attn_implementation='burst' has no attention dropout; got dropout={dropout}")
            if family_problem:  # every rank runs the same tokens: every rank raises
                raise family_problem[0](family_problem[1])
            layer = cache.layers[kv_source_layer(module)]  # a KV-shared layer attends to its source's shard
            keys = None if attention_mask.keys is None else attention_mask.keys[:, layer.positions]
            rows = layer.last_positions if attention_mask.rows is None else layer.last_positions[attention_mask.rows]
            return replicated_attention(q, rows, k, v, layer.positions, group=opts.group,
                                        scale=scale, backend=opts.backend, window=window, causal=call.causal,
                                        softcap=call.softcap, sinks=call.sinks, key_mask=keys), None
        shard = kwargs.get("burst_shard")
        if shard is None and forward_args is not None:  # a layer that drops its kwargs (StableLM): the model's
            shard = _forward_shard(forward_args)
        group = _group_of(opts, shard)
        _, rank, world = group_context(group)
        problem = (_local_problem(module, query, key, attention_mask, dropout, call.cross) or family_problem
                   or _parallel_problem(module, kwargs, forward_args, shard, world))
        if problem is None and not call.cross:  # cross-attention: the queries' positions were checked by self-attention
            text = (_shard_problem(opts, spec, shard, query, rank, world) if shard is not None
                    else _position_problem(opts, kwargs, query, rank, world))
            problem = None if text is None else (ValueError, f"attn_implementation='burst': {text}")
        seq = query.shape[2] * world if shard is None else shard.seq_len
        extra, layout = dict(opts.options), layout_or_default(opts.layout)
        extra.update({name: x for name, x in call.options().items() if name != "window"})
        if window is not None and window[0] + 1 >= seq and (window[1] + 1 >= seq or (call.causal and not window[1])):
            window = None  # the window covers the whole sequence: plain attention
        if shard is not None and problem is None:
            layout = shard.layout
            if window is not None and window[1] != 0:
                problem = ValueError, ("attn_implementation='burst': a two-sided window with a shard_batch batch "
                                       "(causal language models) is not supported")
            mask = shard.mask(None if window is None else window[0])
            if mask is not None:
                extra["mask"], window = mask, None
        if window is not None:
            extra["window"] = window
        missing = sorted(set(extra) - set(spec.options))
        if missing and problem is None:
            takers = [s.name for s in STRATEGIES.values() if set(missing) <= set(s.options)]
            problem = ValueError, (f"strategy {opts.strategy!r} does not take {missing}, which this model's attention "
                                   f"needs (window {window}, softcap {call.softcap}, sinks {call.sinks is not None}): "
                                   f"use one of {takers}")
        if problem is not None:  # the same first collective as every strategy: raises on every rank
            refuse(label(opts.strategy), problem, group)
        if shard is not None:
            shard.attended = True  # what a loss or gather over this batch checks (batch.py)
        out = attention(q, k, v, strategy=opts.strategy, group=group, causal=call.causal, softmax_scale=scale,
                        layout=layout, backend=opts.backend, **extra)
        return out, None

    burst_attention.burst_registration = opts
    return burst_attention


def register(name: str = "burst", *, strategy: str = "burst", layout=None, backend: str = "auto",
             group: Optional[dist.ProcessGroup] = None, **strategy_options) -> Registration:
    """Register ``name`` with transformers' ``AttentionInterface`` and ``AttentionMaskInterface``.

    Call it (on every rank) before building or loading the model, then select it with
    ``attn_implementation=name`` (or ``model.set_attn_implementation(name)``). Options: ``strategy``
    (default ``"burst"``), ``layout`` (default ``None``: :func:`burstattn.hf.shard_batch` picks a
    document-balanced partition for packed or padded batches and the strategy's default otherwise;
    a layout name fixes it), ``backend`` (default ``"auto"``), ``group`` (default: the world) and the
    strategy's own options, e.g. ``ulysses_degree`` and ``ring_degree`` for ``"usp"`` (one of them at
    least, their product the group size) or ``backward`` for ``"burst"``. Registration is global in
    transformers: registering the same name again replaces it.

    Returns the :class:`Registration` in effect. Raises ``ValueError`` for an unknown option or
    strategy, or a layout or option the strategy does not take.
    """
    spec = STRATEGIES.get(strategy)
    if spec is None:
        raise ValueError(f"burstattn.hf.register: strategy must be one of {sorted(STRATEGIES)}, got {strategy!r}")
    takes = [o for o in spec.options if o not in MASK_OPTIONS and o != "backend"]
    unknown = sorted(set(strategy_options) - set(takes))
    if unknown:
        raise ValueError(f"burstattn.hf.register: unknown option(s) {unknown} for strategy {strategy!r}; it takes "
                         f"{list(OPTIONS) + takes} (masks come from the model and the batch)")
    if layout is not None and isinstance(layout, str) and layout not in spec.layouts:
        raise ValueError(f"burstattn.hf.register: strategy {strategy!r} supports layout(s) {list(spec.layouts)}, "
                         f"got {layout!r}")
    if layout is not None and not isinstance(layout, str):
        raise ValueError(f"burstattn.hf.register: layout must be a layout name or None (a document partition is "
                         f"chosen per batch by shard_batch), got {type(layout).__name__}")
    if "backend" not in spec.options:
        raise ValueError(f"burstattn.hf.register: strategy {strategy!r} takes no backend option")
    if strategy == "usp" and not ({"ulysses_degree", "ring_degree", "mesh", "ulysses_group"} & set(strategy_options)):
        raise ValueError("burstattn.hf.register: strategy 'usp' needs ulysses_degree and/or ring_degree (their "
                         "product the group size), a mesh, or ulysses_group and ring_group")
    if not isinstance(name, str) or not name:
        raise ValueError(f"burstattn.hf.register: name must be a non-empty string, got {name!r}")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    opts = Registration(strategy=strategy, layout=layout, backend=backend, group=group,
                        options=dict(strategy_options), name=name)
    AttentionInterface.register(name, make_attention_function(opts))
    AttentionMaskInterface.register(name, make_mask_function(opts))
    return opts


def __getattr__(name: str):
    # names that moved out of this module (the table burstattn.MOVED): resolved, or refused with the new spelling
    return sys.modules["burstattn"].moved_attribute(__name__, name)

"""``attn_implementation="burst"``: burstattn's distributed attention inside transformers models.

:func:`register` adds two functions to transformers' global registries under one name:

* an attention function (``AttentionInterface``) with transformers' signature
  ``fn(module, query [B, Hq, S, D], key [B, Hkv, S_kv, D], value, attention_mask, dropout, scaling,
  **kwargs) -> (out [B, S, Hq, D], None)``;
* its mask function (``AttentionMaskInterface``). Without one, transformers builds no mask for a
  custom implementation and silently drops a padding ``attention_mask``. Ours returns a
  :class:`BurstMask` (or ``None``) and REFUSES padding: a 2-D ``attention_mask`` with a zero
  anywhere raises ``ValueError`` on every rank (one all-reduce of a flag per forward). Pack
  sequences or trim the pads instead.

Two ways a model runs under it:

* sequence-parallel forward (training, scoring): every rank passes its shard from
  :func:`burstattn.hf.shard_batch`; attention is :func:`burstattn.attention` with the registered
  ``strategy``, ``layout`` and ``backend``, and what the model family asks for
  (:func:`burstattn.hf.families.describe`: sliding windows, softcap, sinks, bidirectional encoders,
  cross-attention, a V head size of its own).
* over a :class:`burstattn.hf.ShardedCache` (generation): every rank runs the same tokens, the cache
  keeps each rank's shard of K/V, and the queries attend to every shard with
  :func:`burstattn.infer.sharded.replicated_attention` (partials merged by LSE).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..infer.sharded import rank_world, replicated_attention
from ..strategies import STRATEGIES, attention
from ..strategies.base import start
from .families import describe

OPTIONS = ("strategy", "layout", "backend", "group")


@dataclass(frozen=True)
class BurstOptions:
    """What :func:`register` was given: ``strategy`` (a :data:`burstattn.strategies.STRATEGIES` name),
    ``layout`` (``None``: the strategy's default; must match :func:`shard_batch`'s), ``backend``
    (local kernel) and ``group`` (``None``: the default group)."""

    strategy: str = "burst"
    layout: Optional[str] = None
    backend: str = "auto"
    group: Optional[dist.ProcessGroup] = None


@dataclass(frozen=True)
class BurstMask:
    """What the mask function hands every layer: ``cache`` is the :class:`ShardedCache` of this
    forward (``None`` for a sequence-parallel forward without one)."""

    cache: Any = None


class ShardedOffset(int):
    """The ``kv_offset`` a :class:`ShardedCache` reports to transformers' mask creation: the plain
    int 0 (transformers uses it as such) that also tells our mask function which cache is in use."""

    cache: Any

    def __new__(cls, value: int, cache: Any) -> "ShardedOffset":
        obj = super().__new__(cls, value)
        obj.cache = cache
        return obj


def _group_size(group: Optional[dist.ProcessGroup]) -> int:
    return rank_world(group)[2]


def make_mask_function(opts: BurstOptions):
    """The ``AttentionMaskInterface`` function: :class:`BurstMask`, or ``ValueError`` on every rank
    if any rank's 2-D ``attention_mask`` masks a token (padding is refused, never dropped)."""

    def burst_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                   mask_function=None, attention_mask: Optional[torch.Tensor] = None, **kwargs) -> BurstMask:
        padded = attention_mask is not None and not bool(attention_mask.all())
        if _group_size(opts.group) > 1:
            flag = torch.tensor([int(padded)], dtype=torch.int64)
            if dist.get_backend(opts.group) == "nccl":
                flag = flag.cuda()
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=opts.group)
            any_padded = bool(flag.item())
        else:
            any_padded = padded
        if any_padded:
            where = "this rank's" if padded else "another rank's"
            raise ValueError(f"attn_implementation='burst': {where} attention_mask masks tokens (padding); "
                             "padding masks are not supported: pass unpadded sequences (or pack them "
                             "without pads), or all-ones masks")
        return BurstMask(cache=getattr(kv_offset, "cache", None))

    return burst_mask


def _local_problem(opts: BurstOptions, module, query, key, attention_mask, dropout: float, cross: bool):
    if attention_mask is not None and not isinstance(attention_mask, BurstMask):
        return ValueError, ("attn_implementation='burst' got a prepared 4-D attention mask; custom masks are "
                            "not supported (pass attention_mask=None or a 2-D all-ones mask)")
    if dropout:
        return ValueError, f"attn_implementation='burst' has no attention dropout; got dropout={dropout}"
    if key.shape[2] != query.shape[2] and not cross:
        return ValueError, (f"attn_implementation='burst': {key.shape[2]} keys for {query.shape[2]} queries: a "
                            "cache holds past tokens; generate with past_key_values=burstattn.hf.ShardedCache()")
    return None


def make_attention_function(opts: BurstOptions):
    """The ``AttentionInterface`` function for ``opts`` (see the module docstring)."""
    spec_of = STRATEGIES[opts.strategy]

    def burst_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask=None, dropout: float = 0.0, scaling: Optional[float] = None,
                        **kwargs) -> tuple[torch.Tensor, None]:
        call, problem = describe(module, query, key, kwargs)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        cache = attention_mask.cache if isinstance(attention_mask, BurstMask) else None
        # [B, H, S, D] -> [B, S, H, D]: burstattn's layout
        q, k, v = (x.transpose(1, 2) for x in (query, key, value))
        if cache is not None and not call.cross:
            if dropout:
                raise ValueError(f"attn_implementation='burst' has no attention dropout; got dropout={dropout}")
            if problem:  # every rank runs the same tokens: every rank raises
                raise problem[0](problem[1])
            layer = cache.layers[module.layer_idx]
            q_pos = layer.last_positions
            return replicated_attention(q, q_pos, k, v, layer.positions, group=opts.group, scale=scale,
                                        backend=opts.backend, window=call.window, causal=call.causal,
                                        softcap=call.softcap, sinks=call.sinks), None
        problem = _local_problem(opts, module, query, key, attention_mask, dropout, call.cross) or problem
        seq = query.shape[2] * _group_size(opts.group)
        extra = call.options()
        if call.window is not None and max(call.window) + 1 >= seq + (key.shape[2] - query.shape[2]):
            del extra["window"]  # the window covers the whole sequence: plain attention
        missing = sorted(set(extra) - set(spec_of.options))
        if missing and problem is None:
            takers = [s.name for s in STRATEGIES.values() if set(missing) <= set(s.options)]
            problem = ValueError, (f"strategy {opts.strategy!r} does not take {missing}, which this model's attention "
                                   f"needs (window {call.window}, softcap {call.softcap}, sinks "
                                   f"{call.sinks is not None}); use one of {takers}")
        layout = opts.layout if opts.layout is not None else spec_of.default_layout
        if problem is not None:  # the same first collective as every strategy: raises on every rank
            # (q stands in for k and v, contiguous for the layout, so that the shared check reports
            # this problem and not the shapes)
            start(opts.strategy, q, q, q, group=opts.group, causal=True, softmax_scale=scale, layout="contiguous",
                  extra=problem)
            raise problem[0](problem[1])
        out = attention(q, k, v, strategy=opts.strategy, group=opts.group, causal=call.causal, softmax_scale=scale,
                        layout=layout, backend=opts.backend, **extra)
        return out, None

    return burst_attention


def register(name: str = "burst", **options) -> BurstOptions:
    """Register ``name`` with transformers' ``AttentionInterface`` and ``AttentionMaskInterface``.

    Call it (on every rank) before building or loading the model, then select it with
    ``attn_implementation=name``. Options: ``strategy`` (default ``"burst"``), ``layout``
    (default: the strategy's; must match :func:`burstattn.hf.shard_batch`), ``backend``
    (default ``"auto"``) and ``group`` (default: the world). Registration is global in
    transformers: registering the same name again replaces it.

    Returns the :class:`BurstOptions` in effect. Raises ``ValueError`` for an unknown option or
    strategy, or a layout or option the strategy does not take.
    """
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"burstattn.hf.register: unknown option(s) {unknown}; it takes {list(OPTIONS)}")
    opts = BurstOptions(**options)
    spec = STRATEGIES.get(opts.strategy)
    if spec is None:
        raise ValueError(f"burstattn.hf.register: strategy must be one of {sorted(STRATEGIES)}, got {opts.strategy!r}")
    if opts.layout is not None and opts.layout not in spec.layouts:
        raise ValueError(f"burstattn.hf.register: strategy {opts.strategy!r} supports layout(s) {list(spec.layouts)}, "
                         f"got {opts.layout!r}")
    if "backend" not in spec.options:
        raise ValueError(f"burstattn.hf.register: strategy {opts.strategy!r} takes no backend option")
    if not isinstance(name, str) or not name:
        raise ValueError(f"burstattn.hf.register: name must be a non-empty string, got {name!r}")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, make_attention_function(opts))
    AttentionMaskInterface.register(name, make_mask_function(opts))
    return opts

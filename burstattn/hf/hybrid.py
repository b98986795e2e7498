"""Hybrid transformers models under context parallelism: the one place their mixers are made sequence parallel.

transformers has no interface for the non-attention token mixers of hybrid models (Gated DeltaNet,
KDA, Mamba2, lightning attention, short convolutions): each module runs its own recurrence over the
tokens it is given. :func:`patch_mixers` replaces, on the model's instances, the ``forward`` of every
mixer class in :data:`burstattn.hf.hybrid_mixers.SUPPORTED` by a dispatcher:

* a forward over a :func:`burstattn.hf.shard_batch` batch (its ``burst_shard`` reaches every mixer
  with the decoder layer's keyword arguments): the family's sequence computation
  (the adapters of :mod:`.hybrid_mixers`) with :mod:`burstattn.recurrent`'s state passing and conv halos, over the
  group registered for the batch's ``attn_implementation`` and the batch's layout and documents
  (packed documents and padding reset the state and the convolution): exact, as one process;
* a forward without one on a single process (or under an implementation that is not burstattn's):
  the module's own ``forward``, unchanged;
* generation over a :class:`burstattn.hf.ShardedCache` (every rank runs the same tokens): the family's
  computation continuing from the conv window and recurrent state the cache keeps for the layer, the same
  on every rank (a constant size per layer; the attention layers' K/V stay sharded);
* a hand-sharded forward (no ``burst_shard``, a registered group of several ranks): refused with
  ``ValueError`` (every rank runs the same code path, so every rank raises).

Patched modules are accepted by :func:`burstattn.hf.check_model`; a mixer outside the table is still
refused there by its class name. :class:`burstattn.hf.ContextParallelTrainer` patches its model itself.
"""
from __future__ import annotations

import inspect
import types
from typing import Optional

from torch import nn

from ..comm.groups import group_context
from .families import registration
from .guard import CACHE_KEY, calling_model
from .hybrid_mixers import ADAPTERS, PATCHED, SUPPORTED, CachedOps, ShardedOps

SHARD_KEY = "burst_shard"
STATES = "_burstattn_mixer_states"  # on a ShardedCache: per mixer layer, its conv window and recurrent state
CONFIG = "_burstattn_model_config"  # on a patched module: the model's config (its attn_implementation)


def _sharded_cache(cache) -> bool:
    return cache is not None and type(cache).__name__ == "ShardedCache"


def _shard_of_forward(extra: dict):
    """The ``burst_shard`` of this forward: the mixer's keyword arguments, else the running model's."""
    shard = extra.get(SHARD_KEY)
    if shard is None:
        hit = calling_model(2)
        if hit is not None:
            local = hit[1]
            shard = local.get(SHARD_KEY) or (local.get("kwargs") or {}).get(SHARD_KEY)
    return shard


def _problem(module, shard, cache) -> Optional[str]:
    name = type(module).__name__
    if _sharded_cache(cache):
        return None if shard is None else f"burstattn.hf: {name}: a shard_batch batch with a ShardedCache"
    if shard is None:
        config = getattr(module, "config", None) or module.__dict__.get(CONFIG)
        impl = getattr(config, "_attn_implementation", None)
        opts = registration(impl)
        if opts is not None and group_context(opts.group).world_size > 1:
            return (f"burstattn.hf: {name} in a forward at world size {group_context(opts.group).world_size} without "
                    f"a burstattn.hf.shard_batch batch: its recurrence needs the batch's layout and documents; pass "
                    f"the FULL batch through burstattn.hf.shard_batch(input_ids, labels)")
    # a shard_batch forward with a plain cache (use_cache in eval): the cache is left as the attention
    # layers leave it, holding this rank's shard only (generation continues over a ShardedCache)
    return None


def _dispatcher(adapter, original):
    signature = inspect.signature(original)

    def forward(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs).arguments
        extra = dict(bound.get("kwargs") or {})
        cache = bound.get("cache", extra.get("past_key_values", extra.get("cache_params")))
        shard = _shard_of_forward(extra)
        problem = _problem(self, shard, cache)
        if problem:
            raise ValueError(problem)
        if _sharded_cache(cache):  # generation: every rank the same tokens, the state kept in the cache
            slots = cache.__dict__.setdefault(STATES, {})
            ops = CachedOps(slots.setdefault(getattr(self, "layer_idx", id(self)), {}))
        elif shard is None:
            return original(self, *args, **kwargs)
        else:
            opts = registration(shard.name)
            group = None if opts is None else opts.group
            group = group if getattr(shard, "group", None) is None else shard.group  # a dispatched micro-batch's own
            ops = ShardedOps(dict(group=group, layout=shard.layout, cu_seqlens=shard.cu_seqlens))
        return adapter(self, bound["hidden_states"], bound.get("attention_mask"), ops)

    return forward


def patch_mixers(model: nn.Module) -> list:
    """Make every supported mixer of ``model`` sequence parallel (see the module docstring), in place.

    Call it on every rank, after building or loading the model (before wrapping it in FSDP / DDP).
    Idempotent. Returns the ``named_modules`` paths patched now. Mixers outside the table are left
    as they are (:func:`burstattn.hf.check_model` refuses them by class name)."""
    done = []
    for path, module in model.named_modules():
        entry = SUPPORTED.get(type(module).__name__)
        if entry is None or module.__dict__.get(PATCHED) or not type(module).__module__.startswith("transformers."):
            continue
        original = type(module).forward
        module.forward = types.MethodType(_dispatcher(ADAPTERS[entry[1]], original), module)
        module.__dict__[PATCHED] = entry[1]
        module.__dict__[CONFIG] = getattr(model, "config", None)  # most mixers keep no config of their own
        done.append(path)
    for module in model.modules():  # the forward's guard cached a survey taken before the patch
        module.__dict__.pop(CACHE_KEY, None)
    return done


__all__ = ["patch_mixers", "PATCHED"]

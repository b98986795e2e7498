"""Megatron tensor parallelism of the whole model with ``torch.distributed.tensor.parallel``.

Two variants, the ones BurstAttention compares with:

* ``v1`` (Megatron-LM, Shoeybi et al. 2019): ``wq/wk/wv/w1/w3`` column-parallel (each rank its
  heads and MLP columns), ``wo/w2`` row-parallel with an all-reduce after attention and after the
  MLP; every tp rank holds the full (cp-shard of the) sequence, norms and residuals replicated.
* ``v3`` (tensor + sequence parallelism, Korthikanti et al. 2022; torchtitan's Llama plan): norms
  and residuals sharded along the sequence over tp (``SequenceParallel``); the attention and MLP
  inputs are all-gathered (``PrepareModuleInput(Shard(1) -> Replicate())``) and ``wo/w2``
  reduce-scatter back to sequence shards (``RowwiseParallel(output_layouts=Shard(1))``).

The vocabulary embedding is row-parallel (split over the vocabulary), the output head
column-parallel with replicated logits. Inside attention each rank holds ``Hq/tp`` query heads
and ``Hkv/tp`` kv heads (one replicated kv head when ``tp`` exceeds them: :mod:`.tp_kv`); with
``cp > 1`` they run the context-parallel strategy over ``cp``.
"""
from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

from .mesh import TP_VARIANTS
from .tp_kv import ReplicatedKV, replicated_kv_problem


def tp_problem(config, tp: int, seq_len_cp: int, variant: str):
    """Why the model cannot be split ``tp`` ways (``None`` if it can)."""
    if variant not in TP_VARIANTS:
        return f"tp variant must be one of {TP_VARIANTS}, got {variant!r}"
    for name in ("n_heads", "ffn_dim", "vocab_size"):
        if getattr(config, name) % tp:
            return f"tensor parallelism over {tp} ranks needs {name} ({getattr(config, name)}) divisible by {tp}"
    kv_problem = replicated_kv_problem(config.n_kv_heads, tp)
    if kv_problem:
        return kv_problem
    if config.tie_embeddings and tp > 1:
        return "tensor parallelism does not support tied embeddings (tie_embeddings=True)"
    if variant == "v3" and seq_len_cp % tp:
        return f"tp-v3 shards each rank's {seq_len_cp} tokens over {tp} ranks: they must be divisible"
    return None


def block_plan(variant: str, kv=None) -> dict:
    """The per-block plan (module path -> style) of ``variant``; ``kv``: the style of ``wk`` / ``wv``
    (default column-parallel; :class:`~.tp_kv.ReplicatedKV` when tp exceeds the kv heads)."""
    kv = kv if kv is not None else ColwiseParallel()
    if variant == "v1":
        return {"attention.wq": ColwiseParallel(), "attention.wk": kv,
                "attention.wv": kv, "attention.wo": RowwiseParallel(),
                "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel()}
    return {"attention_norm": SequenceParallel(),
            # Attention.forward(x, positions, attn): only x is a sequence shard
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
            "attention.wq": ColwiseParallel(), "attention.wk": kv, "attention.wv": kv,
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1))}


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, variant: str) -> nn.Module:
    """Parallelize a :class:`~burstattn.models.Llama` in place over the 1-D ``tp_mesh``.

    Input: ``tokens [B, n]`` replicated over tp (``n`` the cp shard); with ``v3`` the residual
    stream between blocks is ``[B, n / tp, dim]`` per rank; the logits ``[B, n, vocab]`` are
    replicated. Returns ``model``."""
    seq = Shard(1) if variant == "v3" else Replicate()
    top = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
           "output": ColwiseParallel(input_layouts=seq, output_layouts=Replicate(), use_local_output=True)}
    if variant == "v3":
        top["norm"] = SequenceParallel()
    parallelize_module(model, tp_mesh, top)
    cfg, tp = model.config, tp_mesh.size()
    kv = ReplicatedKV(cfg.head_dim, cfg.n_kv_heads) if cfg.n_kv_heads % tp else None
    for block in model.layers:
        parallelize_module(block, tp_mesh, block_plan(variant, kv))
    return model

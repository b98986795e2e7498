"""Bytes each rank sends when attending to a sharded KV cache (what ``comm_stats()`` measures).

Notation: P ranks, B batch, Hq/Hkv query/kv heads, D head_dim, e the element size of the model
dtype; partial outputs and LSE travel in float32 (4 bytes). Per attention layer and call:

* decoding, every rank holds the ``s`` new queries (op ``decode``): ``(P-1) * B*Hq*s*(D+1) * 4``.
  For one token that is O(Hq x D), independent of the cache length.
* continuation, pass-Q (ops ``q`` and ``partials``): ``(P-1) * B*m_max*Hq*D * e`` for the queries
  plus ``(P-1) * B*Hq*m_max*(D+1) * 4`` for the partials sent home; ``m_max`` is the most new
  tokens any rank holds.
* continuation, pass-KV (op ``kv``): ``(P-1) * 2*B*S_max*Hkv*D * e``; ``S_max`` is the longest
  shard (cached plus new tokens).

``continuation="auto"`` picks the smaller of the two (pass-Q when few new tokens meet a long
cache, pass-KV when the new tokens are a large share of it, earlier with GQA's small K/V).
"""
from __future__ import annotations

import torch

from ..engine.bytes import element_size

CONTINUATIONS = ("auto", "kv", "q")


def decode_bytes(*, batch: int, new_tokens: int, world_size: int, q_heads: int, head_dim: int) -> int:
    """Bytes one rank sends per layer when ``new_tokens`` replicated queries attend to the cache."""
    return (world_size - 1) * batch * q_heads * new_tokens * (head_dim + 1) * 4


def pass_q_bytes(*, batch: int, max_new_local: int, world_size: int, q_heads: int, head_dim: int,
                 dtype: torch.dtype) -> dict[str, int]:
    """Pass-Q bytes per rank and layer, by op: ``{"q": ..., "partials": ...}``."""
    p = world_size - 1
    return {"q": p * batch * max_new_local * q_heads * head_dim * element_size(dtype),
            "partials": p * batch * q_heads * max_new_local * (head_dim + 1) * 4}


def pass_kv_bytes(*, batch: int, max_shard: int, world_size: int, kv_heads: int, head_dim: int,
                  dtype: torch.dtype) -> dict[str, int]:
    """Pass-KV bytes per rank and layer, by op: ``{"kv": ...}``."""
    return {"kv": (world_size - 1) * 2 * batch * max_shard * kv_heads * head_dim * element_size(dtype)}


def choose_continuation(continuation: str, *, batch: int, max_new_local: int, max_shard: int, world_size: int,
                        q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> str:
    """``"kv"`` or ``"q"``: the requested mode, or for ``"auto"`` the one that sends fewer bytes
    (pass-Q on a tie: it keeps the cache in place)."""
    if continuation not in CONTINUATIONS:
        raise ValueError(f"continuation must be one of {CONTINUATIONS}, got {continuation!r}")
    if continuation != "auto":
        return continuation
    q = sum(pass_q_bytes(batch=batch, max_new_local=max_new_local, world_size=world_size, q_heads=q_heads,
                         head_dim=head_dim, dtype=dtype).values())
    kv = sum(pass_kv_bytes(batch=batch, max_shard=max_shard, world_size=world_size, kv_heads=kv_heads,
                           head_dim=head_dim, dtype=dtype).values())
    return "kv" if kv < q else "q"

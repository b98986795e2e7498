"""Attention of queries against a KV cache that stays sharded over the ranks of a group, on the engine.

Every rank holds a shard of the cache: keys/values ``[B, S_r, Hkv, D]`` at known GLOBAL
positions ``[S_r]`` (int64, increasing). Three exact ways to attend to the whole cache, each a plan of
the one loop (:func:`burstattn.engine.loop.run_plan`) over per-rank positions of any lengths, run by the
engine's forward pass (one kernel choice and one fallback, :func:`burstattn.call.engine_adapter.block_calls`), its
partials merged by the one log-sum-exp merge:

* :func:`replicated_attention` (decoding): every rank holds the same queries; each attends them to
  its own shard (a :func:`~burstattn.engine.plan.local` plan), the partial ``(out, lse)`` are
  all-gathered (op ``"decode"``) and merged in rank order, so every rank gets bit-identical results.
  Bytes per rank: ``(P-1) * B*Hq*Sq*(D+1) * 4`` (float32 partials): O(heads x head_dim) per token,
  never O(cache).
* :func:`pass_q_attention` (continuation, pass-Q): every rank holds ITS new queries; they go
  straight to every other rank (op ``"q"``) and their partials straight back (op ``"partials"``):
  the direct plan of :func:`~burstattn.engine.direct.pass_q_steps`, the next step's queries in
  flight while this one computes. The cache never moves.
* :func:`pass_kv_attention` (continuation, pass-KV): the shards (cached plus new K/V) travel around
  the ring (op ``"kv"``, P-1 hops, the next one prefetched); every rank merges its own queries'
  partials.

Shards of different lengths travel padded to the longest (queries to ``m_max``, cache shards to
``S_max``: every rank posts messages of one size, and the byte formulas of
:mod:`burstattn.infer.bytes` count exactly that); the padding is never attended, since the plan's
block ops cover the real positions only.

Visibility is by global positions: key ``j`` is visible to query ``i`` iff ``j <= i`` (``causal``,
the default; ``causal=False`` for cross-attention over an encoder's sharded K/V) and
``i - left <= j <= i + right`` with a ``window=(left, right)`` (the one window meaning,
:class:`burstattn.AttnMask`'s). Score modifiers as everywhere: ``softcap``, and attention ``sinks``
added once after the merge; V may have a head size of its own.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..call.call import Call
from ..call.engine_adapter import CallPositions, block_calls, kernel_needs
from ..comm.collectives import Collectives
from ..comm.groups import group_context
from ..comm.stats import active_stats
from ..comm.transport import Transport
from ..config import normalize_window
from ..engine.bytes import accum_dtype
from ..engine.direct import direct, pass_q_steps
from ..engine.merge import add_sinks_, merge_
from ..engine.pairs import ops_from_positions
from ..engine.plan import Channels, local, ring
from ..engine.run import attention_partials
from ..kernels import resolve_backend
from ..masks.blocks import mask_ops
from ..masks.spec import AttnMask

PASS_Q = Channels(q="q", dq="partials")


def _setup(q: torch.Tensor, v: torch.Tensor, q_pos: list, k_pos: list, *, scale: float, backend: str, window,
           causal: bool, softcap: Optional[float]):
    """``(ops_of, calls)`` of a call against cache shards: the block ops of every (query owner, key owner)
    from their positions (under ``window``, as an :class:`~burstattn.AttnMask`), and the kernel calls."""
    window = normalize_window(window)
    mask = None if window is None else AttnMask(window=window)
    cfg = Call(causal=causal, softmax_scale=scale, softcap=softcap, mask=mask)
    cfg = replace(cfg, backend=resolve_backend(backend, q.device, q.dtype, kernel_needs(cfg, q.shape[-1], v.shape[-1])))
    n = 1 + max([int(p.max()) for p in list(q_pos) + list(k_pos) if p.numel()], default=0)
    calls = block_calls(cfg, mask is not None, CallPositions(list(q_pos), list(q_pos), list(k_pos), n, n), scale, q, v,
                        mask=mask)
    if mask is None:
        return ops_from_positions(q_pos, k_pos, causal), calls
    cache: dict = {}

    def ops_of(a: int, b: int):
        if (a, b) not in cache:
            cache[(a, b)] = mask_ops(mask, causal, q_pos[a], k_pos[b], n, n)
        return cache[(a, b)]
    return ops_of, calls


def partial_attention(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      k_pos: torch.Tensor, *, scale: float, backend: str = "auto", window=None,
                      causal: bool = True, softcap: Optional[float] = None,
                      key_mask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q [B, Sq, Hq, D]`` to the local keys ``k [B, Sk, Hkv, D]``, ``v [B, Sk, Hkv, Dv]`` only:
    one step of the engine on a :func:`~burstattn.engine.plan.local` plan.

    ``key_mask`` (bool ``[B, Sk]``, True = attend): per batch row, keys that are padding are never
    attended (rows then differ, so each row runs on its own).

    Returns ``out [B, Hq, Sq, Dv]`` and ``lse [B, Hq, Sq]``, both float32 (float64 for float64
    inputs), ``out = 0`` and ``lse = -inf`` on rows that see no local key (also when ``Sk == 0``).
    """
    if key_mask is not None and not bool(key_mask.all()):
        parts = [partial_attention(q[b:b + 1], q_pos, k[b:b + 1, key_mask[b]], v[b:b + 1, key_mask[b]],
                                   k_pos[key_mask[b].to(k_pos.device)], scale=scale, backend=backend, window=window,
                                   causal=causal, softcap=softcap)
                 for b in range(q.shape[0])]
        return torch.cat([o for o, _ in parts]), torch.cat([l for _, l in parts])
    b, sq, hq, _ = q.shape
    if sq == 0 or k.shape[1] == 0:
        acc = accum_dtype(q.dtype)
        return (torch.zeros(b, hq, sq, v.shape[-1], dtype=acc, device=q.device),
                torch.full((b, hq, sq), -math.inf, dtype=acc, device=q.device))
    ops_of, calls = _setup(q, v, [q_pos.cpu()], [k_pos.cpu()], scale=scale, backend=backend, window=window,
                           causal=causal, softcap=softcap)
    return attention_partials(None, local(0, [0], ops_of), calls, q, k, v, hold_kv=True)


def _merge_parts(parts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``parts [P, B, Hq, Sq, D+1]`` (output, then lse in the last column) -> merged
    ``out [B, Hq, Sq, D]``, ``lse [B, Hq, Sq]`` (rank order)."""
    out, lse = parts[0, ..., :-1].clone(), parts[0, ..., -1].clone()
    for r in range(1, parts.shape[0]):
        merge_(out, lse, parts[r, ..., :-1], parts[r, ..., -1])
    return out, lse


def replicated_attention(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         k_pos: torch.Tensor, *, group: Optional[dist.ProcessGroup] = None, scale: float,
                         backend: str = "auto", window=None, causal: bool = True, softcap: Optional[float] = None,
                         sinks: Optional[torch.Tensor] = None, key_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Exact attention of queries held by EVERY rank (``q [B, Sq, Hq, D]``, the same on every rank)
    to the whole sharded cache (this rank's ``k [B, S_r, Hkv, D]``, ``v [B, S_r, Hkv, Dv]`` at
    ``k_pos [S_r]``; ``key_mask [B, S_r]``: False for padded keys, never attended); ``sinks [Hq]`` join
    every row's softmax once, after the merge.

    Returns ``[B, Sq, Hq, Dv]`` in q's dtype, identical on every rank. Sends
    ``(P-1) * B*Hq*Sq*(Dv+1) * 4`` bytes (op ``"decode"``).
    """
    where = group_context(group)
    out, lse = partial_attention(q, q_pos, k, v, k_pos, scale=scale, backend=backend, window=window, causal=causal,
                                 softcap=softcap, key_mask=key_mask)
    if where.world_size > 1:
        packed = torch.cat([out, lse.unsqueeze(-1)], dim=-1)  # [B, Hq, Sq, Dv+1]
        parts = Collectives(where.group, "forward", active_stats()).all_gather(packed, "decode")
        out, lse = _merge_parts(parts)
    if sinks is not None:
        add_sinks_(out, lse, sinks.detach())
    return out.transpose(1, 2).to(q.dtype)  # [B, Hq, Sq, Dv] -> [B, Sq, Hq, Dv]


def _padded(x: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    """``x`` zero-padded (or kept) to ``length`` along ``dim``."""
    extra = length - x.shape[dim]
    if extra <= 0:
        return x.contiguous()
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def pass_q_attention(q: torch.Tensor, q_pos: Sequence[torch.Tensor], k: torch.Tensor, v: torch.Tensor,
                     k_pos: torch.Tensor, *, group: Optional[dist.ProcessGroup] = None, scale: float,
                     backend: str = "auto", window=None) -> torch.Tensor:
    """Pass-Q: this rank's new queries ``q [B, m_r, Hq, D]`` attend to every rank's cache shard.

    Args:
        q_pos: the query positions of EVERY rank (``q_pos[r]``: ``[m_r]``), known to all ranks
            from the placement policy; ``q_pos[rank]`` belongs to ``q``.
        k, v, k_pos: this rank's shard (cached and new tokens) ``[B, S_r, Hkv, D]``, ``[S_r]``.
    Returns:
        ``[B, m_r, Hq, D]`` in q's dtype. Bytes sent: ``(P-1) * B*m_max*Hq*D * e`` (op ``"q"``) plus
        ``(P-1) * B*Hq*m_max*(D+1) * 4`` (op ``"partials"``), ``m_max = max_r m_r``.
    """
    where = group_context(group)
    if where.world_size == 1:
        return replicated_attention(q, q_pos[0], k, v, k_pos, scale=scale, backend=backend, window=window)
    p, rank, m = where.world_size, where.rank, q.shape[1]
    m_max = max(int(x.numel()) for x in q_pos)
    k_of = [k_pos.cpu()] * p  # every helper pairs queries with ITS OWN shard: only index rank is read here
    ops_of, calls = _setup(q, v, [x.cpu() for x in q_pos], k_of, scale=scale, backend=backend, window=window,
                           causal=True, softcap=None)
    plan = direct(rank, pass_q_steps(rank, p), p, ops_of, m_max, PASS_Q)
    comm = Transport(where.group, "forward", active_stats())
    out, _ = attention_partials(comm, plan, calls, _padded(q, m_max, 1), k, v, wire=accum_dtype(q.dtype))
    return out[:, :, :m].transpose(1, 2).to(q.dtype)


def pass_kv_attention(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      k_pos: Sequence[torch.Tensor], *, group: Optional[dist.ProcessGroup] = None,
                      scale: float, backend: str = "auto", window=None) -> torch.Tensor:
    """Pass-KV: every rank's shard (cached and new K/V) travels around the ring; this rank's new
    queries ``q [B, m_r, Hq, D]`` at ``q_pos [m_r]`` merge the partials of every shard.

    Args:
        k, v: this rank's shard ``[B, S_rank, Hkv, D]``.
        k_pos: the key positions of EVERY rank's shard (``k_pos[r]``: ``[S_r]``), known to all
            ranks from the placement policy.
    Returns:
        ``[B, m_r, Hq, D]`` in q's dtype. Bytes sent: ``(P-1) * 2*B*S_max*Hkv*D * e`` (op ``"kv"``),
        ``S_max = max_r S_r``.
    """
    where = group_context(group)
    if where.world_size == 1:
        return replicated_attention(q, q_pos, k, v, k_pos[0], scale=scale, backend=backend, window=window)
    p, rank = where.world_size, where.rank
    s_max = max(int(x.numel()) for x in k_pos)
    ops_of, calls = _setup(q, v, [q_pos.cpu()] * p, [x.cpu() for x in k_pos], scale=scale, backend=backend,
                           window=window, causal=True, softcap=None)
    comm = Transport(where.group, "forward", active_stats())
    out, _ = attention_partials(comm, ring(rank, p, ops_of, "kv"), calls, q, _padded(k, s_max, 1),
                                _padded(v, s_max, 1))
    return out.transpose(1, 2).to(q.dtype)

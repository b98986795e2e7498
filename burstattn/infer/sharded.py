"""Attention of queries against a KV cache that stays sharded over the ranks of a group.

Every rank holds a shard of the cache: keys/values ``[B, S_r, Hkv, D]`` at known GLOBAL
positions ``[S_r]`` (int64, increasing). Three exact ways to attend to the whole cache; all end
in the engine's log-sum-exp merge (:func:`burstattn.engine.merge.merge_`), in rank order, so
every rank that merges the same partials gets bit-identical results:

* :func:`replicated_attention` (decoding): every rank holds the same queries; each attends
  them to its own shard with the local kernel, the partial ``(out, lse)`` are all-gathered
  (op ``"decode"``) and merged. Bytes per rank: ``(P-1) * B*Hq*Sq*(D+1) * 4`` (float32
  partials): O(heads x head_dim) per token, never O(cache).
* :func:`pass_q_attention` (continuation, pass-Q): every rank holds ITS new queries; the
  queries are all-gathered (op ``"q"``), every rank attends every rank's queries to its shard,
  and the partials go back to their owners with one all-to-all (op ``"partials"``).
* :func:`pass_kv_attention` (continuation, pass-KV): the shards (cached plus new K/V) travel
  around the ring (op ``"kv"``, P-1 steps); every rank merges its own queries' partials.

Visibility is by global positions: key ``j`` is visible to query ``i`` iff ``j <= i`` (``causal``,
the default; ``causal=False`` for cross-attention over an encoder's sharded K/V) and
``i - left <= j <= i + right`` with a ``window=(left, right)`` (the one window meaning of
:func:`burstattn.config.normalize_window`). Score modifiers as everywhere: ``softcap``, and
attention ``sinks`` added once after the merge; V may have a head size of its own. Byte formulas:
:mod:`burstattn.infer.formulas`.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..comm.collectives import Collectives
from ..comm.ring import RingComm
from ..comm.stats import active_stats
from ..config import normalize_window
from ..engine.merge import add_sinks_, merge_
from ..kernels import ScoreMods, get_kernel, resolve_backend


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window=None, causal: bool = True) -> torch.Tensor:
    """Bool ``[Sq, Sk]``: key ``k_pos[j]`` visible to query ``q_pos[i]`` by global position: ``j <= i``
    when ``causal``, and ``i - left <= j <= i + right`` for ``window=(left, right)``."""
    diff = q_pos.view(-1, 1) - k_pos.view(1, -1)  # [Sq, Sk]
    seen = diff >= 0 if causal else torch.ones_like(diff, dtype=torch.bool)
    left, right = normalize_window(window) or (None, None)
    if left is not None:
        seen &= diff <= left
    if right is not None:
        seen &= diff >= -right
    return seen


def partial_attention(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      k_pos: torch.Tensor, *, scale: float, backend: str = "auto", window=None,
                      causal: bool = True, softcap: Optional[float] = None,
                      key_mask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q [B, Sq, Hq, D]`` to the local keys ``k [B, Sk, Hkv, D]``, ``v [B, Sk, Hkv, Dv]`` only.

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
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    b, sq, hq, d = q.shape
    out = torch.zeros(b, hq, sq, v.shape[-1], dtype=acc, device=q.device)
    lse = torch.full((b, hq, sq), -math.inf, dtype=acc, device=q.device)
    if sq == 0 or k.shape[1] == 0:
        return out, lse
    seen = visible(q_pos.to(q.device), k_pos.to(q.device), window, causal)
    rows = seen.any(dim=1)  # [Sq]
    if not rows.any():
        return out, lse
    mask = None if bool(seen.all()) else seen
    needs = {n for n, on in (("mask", mask is not None), ("softcap", softcap is not None),
                             ("v_head_dim", v.shape[-1] != d)) if on}
    name = resolve_backend(backend, q.device, q.dtype, needs - {"mask"})
    kernel = get_kernel(name if needs <= get_kernel(name).supports else "reference")
    # [B, S, H, D] -> [B, H, S, D]: the kernels' layout
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    o, l = kernel.forward(qt, kt, vt, scale, False, mask, mods=ScoreMods(softcap=softcap))
    out.copy_(o.to(acc).nan_to_num_(0.0))
    lse.copy_(l.to(acc))
    lse[:, :, ~rows] = -math.inf
    out[:, :, ~rows] = 0.0
    return out, lse


def _merge_parts(parts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``parts [P, B, Hq, Sq, D+1]`` (output, then lse in the last column) -> merged
    ``out [B, Hq, Sq, D]``, ``lse [B, Hq, Sq]`` (rank order)."""
    out, lse = parts[0, ..., :-1].clone(), parts[0, ..., -1].clone()
    for r in range(1, parts.shape[0]):
        merge_(out, lse, parts[r, ..., :-1], parts[r, ..., -1])
    return out, lse


def rank_world(group: Optional[dist.ProcessGroup]) -> tuple[Optional[dist.ProcessGroup], int, int]:
    """``(group, rank, world_size)``: ``None`` means the default group, or a world of one without
    ``torch.distributed`` (then a given ``group`` raises ``ValueError``)."""
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise ValueError("group was given but torch.distributed is not initialized")
        return None, 0, 1
    group = group if group is not None else dist.group.WORLD
    return group, dist.get_rank(group), dist.get_world_size(group)


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
    group, _, world = rank_world(group)
    out, lse = partial_attention(q, q_pos, k, v, k_pos, scale=scale, backend=backend, window=window, causal=causal,
                                 softcap=softcap, key_mask=key_mask)
    if world > 1:
        packed = torch.cat([out, lse.unsqueeze(-1)], dim=-1)  # [B, Hq, Sq, Dv+1]
        parts = Collectives(group, "forward", active_stats()).all_gather(packed, "decode")
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
    group, rank, world = rank_world(group)
    if world == 1:
        return replicated_attention(q, q_pos[0], k, v, k_pos, scale=scale, backend=backend, window=window)
    b, m, hq, d = q.shape
    m_max = max(int(p.numel()) for p in q_pos)
    coll = Collectives(group, "forward", active_stats())
    all_q = coll.all_gather(_padded(q, m_max, 1), "q")  # [P, B, m_max, Hq, D]
    parts = []
    for r in range(world):
        pos = _padded(q_pos[r].to(k_pos.device), m_max, 0)
        o, l = partial_attention(all_q[r], pos, k, v, k_pos, scale=scale, backend=backend, window=window)
        keep = torch.arange(m_max, device=q.device) < q_pos[r].numel()  # padded query rows see nothing
        l[:, :, ~keep] = -math.inf
        o[:, :, ~keep] = 0.0
        parts.append(torch.cat([o, l.unsqueeze(-1)], dim=-1))  # [B, Hq, m_max, D+1]
    back = coll.all_to_all(torch.stack(parts), "partials")  # [P, B, Hq, m_max, D+1]: entry r from rank r
    out, _ = _merge_parts(back)
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
    group, rank, world = rank_world(group)
    if world == 1:
        return replicated_attention(q, q_pos, k, v, k_pos[0], scale=scale, backend=backend, window=window)
    s_max = max(int(p.numel()) for p in k_pos)
    # K and V packed in one buffer per step: [2, B, S_max, Hkv, D]
    block = torch.stack([_padded(k, s_max, 1), _padded(v, s_max, 1)])
    out, lse = partial_attention(q, q_pos, k, v, k_pos[rank], scale=scale, backend=backend, window=window)
    comm = RingComm(group, "forward", active_stats())
    for step in range(1, world):
        recv = torch.empty_like(block)
        comm.send_recv("kv", block, recv)
        comm.commit("kv", step)
        comm.wait("kv", step)
        block, src = recv, (rank - step) % world
        n = int(k_pos[src].numel())
        o, l = partial_attention(q, q_pos, block[0, :, :n], block[1, :, :n], k_pos[src], scale=scale,
                                 backend=backend, window=window)
        merge_(out, lse, o, l)
    return out.transpose(1, 2).to(q.dtype)

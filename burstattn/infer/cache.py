"""The sharded KV cache of :mod:`burstattn.infer`: every rank keeps the K/V of its own tokens.

Per layer, this rank holds ``keys[l], values[l] [B, S_rank, Hkv, D]`` (already rotated) of the
tokens at the global positions ``positions_of[rank] [S_rank]`` (increasing). Every rank also keeps
``positions_of[r]`` for EVERY rank r (a few int64 per token, no K/V): the placement policy of
:mod:`burstattn.infer.placement` is deterministic, so all ranks agree on it without talking, and
pass-KV / pass-Q need the other shards' positions.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .placement import placement_positions


@dataclass
class ShardedKVCache:
    """This rank's shard of every layer's K/V, plus every rank's token positions.

    Attributes:
        rank, world_size: this rank in the cache's group.
        n_layers: number of attention layers.
        keys, values: per layer ``[B, S_rank, Hkv, D]`` (``None`` before the first token).
        positions_of: per rank, the global positions it holds ``[S_r]`` (int64).
        total: global number of cached tokens.
    """

    rank: int
    world_size: int
    n_layers: int
    keys: list = field(default_factory=list)
    values: list = field(default_factory=list)
    positions_of: list = field(default_factory=list)
    total: int = 0
    _buffers: dict = field(default_factory=dict, repr=False)  # layer -> (keys, values) with spare capacity

    def __post_init__(self) -> None:
        self.keys = [None] * self.n_layers
        self.values = [None] * self.n_layers
        self.positions_of = [torch.zeros(0, dtype=torch.long) for _ in range(self.world_size)]

    @property
    def lengths(self) -> list[int]:
        """Every rank's shard length."""
        return [int(p.numel()) for p in self.positions_of]

    @property
    def positions(self) -> torch.Tensor:
        """This rank's positions ``[S_rank]``."""
        return self.positions_of[self.rank]

    def reserve(self, positions_of: list[torch.Tensor]) -> torch.Tensor:
        """Add the new tokens' positions (per rank; from a prefill layout or
        :func:`~burstattn.infer.placement.placement_positions`); returns this rank's new ones. The
        layers' K/V follow with :meth:`append`."""
        self.positions_of = [torch.cat([old, new]) for old, new in zip(self.positions_of, positions_of)]
        self.total += sum(int(p.numel()) for p in positions_of)
        return positions_of[self.rank]

    def place(self, m: int) -> list[torch.Tensor]:
        """Per rank, the positions of ``m`` new tokens appended after the cache (balanced policy)."""
        return placement_positions(self.lengths, self.total, m)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append this rank's new ``k, v [B, s, Hkv, D]`` to ``layer``; returns the layer's shard
        (views of buffers with spare room: see :func:`append_rows`)."""
        used = 0 if self.keys[layer] is None else self.keys[layer].shape[1]
        bufs = self._buffers.get(layer, (None, None))
        (bk, self.keys[layer]), (bv, self.values[layer]) = (append_rows(b, used, x, 1) for b, x in zip(bufs, (k, v)))
        self._buffers[layer] = (bk, bv)
        return self.keys[layer], self.values[layer]

    def local_bytes(self) -> int:
        """Bytes of K/V this rank's tokens take (all layers; the buffers' spare capacity not counted)."""
        return sum(k.numel() * k.element_size() * 2 for k in self.keys if k is not None)


def append_rows(buffer, used: int, x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Write ``x`` after the first ``used`` rows (along ``dim``) of ``buffer``, growing it when full;
    returns ``(buffer, view of the used rows)``. The buffer grows by an eighth (at least 256 rows), so
    an appended token costs O(1) copies amortised (not a copy of the whole cache, as ``torch.cat``
    would) and the spare room stays under 1/8 of the cache plus 256 rows."""
    new = used + x.shape[dim]
    if buffer is None or buffer.shape[dim] < new:
        shape = list(x.shape)
        shape[dim] = new + max(256, new // 8)
        grown = x.new_empty(shape)
        if used:
            grown.narrow(dim, 0, used).copy_(buffer.narrow(dim, 0, used))
        buffer = grown
    buffer.narrow(dim, used, x.shape[dim]).copy_(x.detach())
    return buffer, buffer.narrow(dim, 0, new)


def kv_bytes(*, n_layers: int, batch: int, tokens: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of K/V for ``tokens`` cached tokens over ``n_layers`` layers."""
    return 2 * n_layers * batch * tokens * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

"""``ShardedCache``: a transformers ``Cache`` in which every rank keeps only its shard of the K/V.

Under ``model.generate(input_ids, past_key_values=ShardedCache(), ...)`` with
``attn_implementation="burst"`` every rank runs the same tokens (the same prompt, then the same
greedy tokens). Each layer's ``update`` receives the new K/V of all those tokens and keeps only
this rank's share, placed by :mod:`burstattn.infer.placement` (contiguous chunks, water-filled so
the shards stay balanced; a decoded token goes to the shortest shard). The attention function then
attends the (replicated) queries to every shard and merges the partials exactly, so no rank ever
holds the whole cache: per rank and layer the cache is ``ceil(T / P)`` tokens of
``[B, Hkv, ., D]`` keys and values.

``get_seq_length`` is the GLOBAL number of cached tokens (what ``generate`` uses for positions).
Beam search, cropping (assisted decoding) and batch re-indexing would need the shards moved
between ranks and raise ``NotImplementedError``.

The ranks must feed the same tokens: a sharded cache that holds K/V of tokens another rank never
chose is silently wrong. So every forward checks it with the cross-rank check
(:func:`burstattn.comm.agree.agree`, op ``"agree"``, 8 bytes per rank): a checksum of the first layer's
new keys, which depend only on the token ids and positions. Sampling (``do_sample=True``) with per-rank
RNG states then raises ``ValueError`` on every rank instead of drifting apart; seed the ranks alike
before ``generate`` (the logits are bit-identical on every rank, so equal RNG states sample equal tokens).

transformers 5.24 renamed the model's ``past_key_values`` argument to ``cache`` (the old name is
deprecated until 5.40); :func:`cache_kwargs` gives whichever the installed model takes.
"""
from __future__ import annotations

import inspect
from typing import Optional

import torch
import torch.distributed as dist
from transformers.cache_utils import Cache, CacheLayerMixin

from ..comm.agree import agree
from ..comm.groups import group_context
from ..comm.stats import active_stats
from ..config import checksum
from ..infer.cache import append_rows
from ..infer.placement import placement_counts
from .attention import ShardedOffset


class ShardedLayer(CacheLayerMixin):
    """One layer's shard: ``keys, values [B, Hkv, S_rank, D]`` at global ``positions [S_rank]``.

    ``lengths`` holds every rank's shard length (the same on every rank); ``last_positions`` are
    the global positions of the tokens of the latest ``update`` (the queries of this forward).
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__()
        self.rank, self.world_size = rank, world_size
        self.lengths = [0] * world_size
        self.total = 0
        self.positions = torch.zeros(0, dtype=torch.long)
        self.last_positions = torch.zeros(0, dtype=torch.long)
        self._kbuf = self._vbuf = None  # buffers with spare room behind keys / values

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h, _, d = key_states.shape
        self.keys = key_states.new_zeros(b, h, 0, d)
        self.values = value_states.new_zeros(b, h, 0, d)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Keep this rank's share of the new ``[B, Hkv, S, D]`` K/V (the same on every rank); returns
        this rank's whole shard ``(keys, values)``."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        s = key_states.shape[-2]
        counts = placement_counts(self.lengths, s)
        lo = sum(counts[:self.rank])
        mine = slice(lo, lo + counts[self.rank])
        used = self.keys.shape[-2]
        self._kbuf, self.keys = append_rows(self._kbuf, used, key_states[:, :, mine], 2)
        self._vbuf, self.values = append_rows(self._vbuf, used, value_states[:, :, mine], 2)
        new = torch.arange(self.total, self.total + s, dtype=torch.long)
        self.positions = torch.cat([self.positions, new[mine]])
        self.last_positions = new
        self.lengths = [n + c for n, c in zip(self.lengths, counts)]
        self.total += s
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.total + query_length, 0

    def get_seq_length(self) -> int:
        return self.total

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.__init__(self.rank, self.world_size)

    def _refuse(self, what: str):
        raise NotImplementedError(f"ShardedCache does not support {what} (it would move shards between ranks); "
                                  "use greedy or sampling generation with num_beams=1")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._refuse("beam search")

    def crop(self, tokens_to_remove: int) -> None:
        self._refuse("cropping (assisted decoding)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            self._refuse("repeating the batch (num_return_sequences > 1)")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._refuse("selecting batch entries")


class ShardedCache(Cache):
    """A transformers ``Cache`` keeping this rank's shard of every layer's K/V.

    Args:
        group: the process group the model's ``attn_implementation="burst"`` was registered with
            (``None``: the default group, or one process).

    Use a fresh cache per ``generate`` call (every rank must build it and run the same tokens).
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None) -> None:
        super().__init__(layers=[])
        self.group = group
        _, self.rank, self.world_size = group_context(group)
        self._first_layer = None  # the first layer with K/V (the token check's)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The global number of cached tokens (of the first layer with K/V: 0 may be a hybrid's mixer)."""
        idx = layer_idx if self._first_layer is None or layer_idx != 0 else self._first_layer
        return self.layers[idx].get_seq_length() if idx < len(self.layers) else 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self._first_layer is None:  # a hybrid model's first layers may hold no K/V (mixers)
            self._first_layer = layer_idx
        if layer_idx == self._first_layer and self.world_size > 1:
            self._check_same_tokens(key_states)
        while len(self.layers) <= layer_idx:
            self.layers.append(ShardedLayer(self.rank, self.world_size))
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _check_same_tokens(self, key_states: torch.Tensor) -> None:
        """Raise the same ``ValueError`` (:class:`~burstattn.comm.agree.Disagreement`) on every rank unless every
        rank feeds the same tokens: the first layer's new keys ``[B, Hkv, S, D]`` (a function of the token ids
        and positions only; bit-identical on every rank for the same tokens) agree. Compared by the checksum
        of two sums per batch row reduced where the keys live (``[B, 2]`` float64: plain and cosine-weighted)."""
        k = key_states.detach().double()
        weights = torch.cos(torch.arange(k[0].numel(), dtype=torch.float64, device=k.device)).view_as(k[0])
        sums = torch.stack([k.sum(dim=(1, 2, 3)), (k * weights).sum(dim=(1, 2, 3))], dim=1)  # [B, 2]
        signature = (("the cached length", str(self.get_seq_length())),
                     ("the tokens fed (checksum of the first layer's new keys)", f"crc32 {checksum(sums):08x}"))
        agree("ShardedCache", signature, self.group, stats=active_stats(), op="agree",
              hint="every rank must generate the same tokens (sampling with per-rank RNG states, or different "
                   "prompts?): seed every rank alike before generate (e.g. torch.manual_seed(s) on every rank) "
                   "or sample greedily")

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` for transformers' mask creation; the offset (0) also carries
        this cache to burstattn's mask function."""
        kv_length = query_length if layer_idx >= len(self.layers) else self.layers[layer_idx].total + query_length
        return kv_length, ShardedOffset(0, self)

    def local_bytes(self) -> int:
        """Bytes of K/V this rank holds (all layers)."""
        return sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in self.layers if layer.is_initialized)


def cache_kwargs(model, cache: Cache) -> dict:
    """``{"cache": cache}`` for transformers >= 5.24 (whose models take ``cache``), else
    ``{"past_key_values": cache}``: pass it to ``model(...)`` or ``model.generate(...)``."""
    params = inspect.signature(model.forward).parameters
    return {"cache": cache} if "cache" in params else {"past_key_values": cache}

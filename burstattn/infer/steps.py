"""The three forwards of generation over a sharded KV cache, on :class:`burstattn.models.Llama`.

Each plugs an attention callable ``(q [B, n, Hq, D], k, v [B, n, Hkv, D]) -> [B, n, Hq, D]`` into
``model(tokens, positions, attn=...)``; the callable is called once per layer, in order, and
stores this rank's K/V in the cache on the way.

* :func:`prefill`: the prompt sharded over the group in the strategy's layout (right-padded to a
  length the layout splits: under causal attention no real token sees a pad, and the pads are
  never cached), any strategy. Every rank keeps the K/V of its own tokens; nothing is gathered.
* :func:`decode_step`: one new token, run by every rank (the same token, the same hidden state);
  its K/V go to the shortest shard (placement policy) and its query attends to every shard
  (:func:`~burstattn.infer.sharded.replicated_attention`).
* :func:`continue_prompt`: a further prompt appended to the cache, split over the ranks by the
  placement policy; pass-KV or pass-Q by the bytes formula.

The next token (greedy) is the argmax of the last position's logits; the rank holding it shares it
with one all-gather of ``B`` int64 (op ``"token"``).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..comm.collectives import Collectives
from ..comm.groups import group_context
from ..comm.stats import active_stats
from ..layouts.named import layout_or_default, local_positions
from ..strategies import attention
from .bytes import choose_continuation
from .cache import ShardedKVCache
from .sharded import pass_kv_attention, pass_q_attention, replicated_attention


class LayerCalls:
    """Base of the attention callables: counts the layers of one forward."""

    def __init__(self, cache: ShardedKVCache) -> None:
        self.cache, self.layer = cache, 0

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = self.attend(self.layer, q, k, v)
        self.layer += 1
        return out

    def attend(self, layer: int, q, k, v) -> torch.Tensor:
        raise NotImplementedError


class PrefillAttention(LayerCalls):
    """The strategy over the prompt shards; caches this rank's real (non-pad) tokens."""

    def __init__(self, cache, keep: torch.Tensor, strategy: str, group, layout, options: dict) -> None:
        super().__init__(cache)
        self.keep, self.strategy, self.group, self.layout, self.options = keep, strategy, group, layout, options

    def attend(self, layer, q, k, v):
        self.cache.append(layer, k[:, self.keep], v[:, self.keep])
        return attention(q, k, v, strategy=self.strategy, group=self.group, causal=True, layout=self.layout,
                         **self.options)


class CachedAttention(LayerCalls):
    """New tokens against the whole sharded cache: ``mode`` ``"decode"``, ``"q"`` or ``"kv"``."""

    def __init__(self, cache, mode: str, q_positions: list[torch.Tensor], group, backend: str) -> None:
        super().__init__(cache)
        self.mode, self.q_positions, self.group, self.backend = mode, q_positions, group, backend

    def attend(self, layer, q, k, v):
        c = self.cache
        mine = self.q_positions[c.rank]
        if self.mode == "decode":  # every rank runs the token; only the shard it is placed on keeps it
            keep = k if mine.numel() else k[:, :0]
            keys, values = c.append(layer, keep, v[:, :keep.shape[1]])
            return replicated_attention(q, self.q_positions_all(), keys, values, c.positions, group=self.group,
                                        scale=q.shape[-1] ** -0.5, backend=self.backend)
        dummy = mine.numel() == 0  # a rank without new tokens ran one stand-in token: drop it here
        if dummy:
            q, k, v = q[:, :0], k[:, :0], v[:, :0]
        keys, values = c.append(layer, k, v)
        if self.mode == "q":
            out = pass_q_attention(q, self.q_positions, keys, values, c.positions, group=self.group,
                                   scale=q.shape[-1] ** -0.5, backend=self.backend)
        else:
            out = pass_kv_attention(q, mine, keys, values, c.positions_of, group=self.group,
                                    scale=q.shape[-1] ** -0.5, backend=self.backend)
        return out.new_zeros(out.shape[0], 1, *out.shape[2:]) if dummy else out

    def q_positions_all(self) -> torch.Tensor:
        return torch.cat(self.q_positions)


def _share_token(logits_last: Optional[torch.Tensor], owner: int, batch: int, group, device) -> torch.Tensor:
    """Greedy next token ``[B]`` (int64) from the rank ``owner`` that holds the last position."""
    group, rank, world = group_context(group)
    token = (logits_last.argmax(-1) if rank == owner else torch.zeros(batch, dtype=torch.long, device=device))
    if world == 1:
        return token
    return Collectives(group, "forward", active_stats()).all_gather(token, "token")[owner]


def padded_length(n: int, world: int, layout) -> int:
    """The shortest length >= ``n`` that ``layout`` splits over ``world`` ranks."""
    unit = 2 * world if layout == "zigzag" else world
    return -(-n // unit) * unit


@torch.no_grad()
def prefill(model, tokens: torch.Tensor, cache: ShardedKVCache, *, strategy: str = "burst",
            group: Optional[dist.ProcessGroup] = None, layout: Optional[str] = None,
            **options) -> torch.Tensor:
    """Run the prompt ``tokens [B, N]`` (the same on every rank) sharded over ``group``; fill the
    empty ``cache`` with this rank's tokens; return the first new token ``[B]`` on every rank."""
    group, rank, world = group_context(group)
    layout = layout_or_default(layout)
    b, n = tokens.shape
    padded = padded_length(n, world, layout)
    every = [local_positions(padded, r, world, layout) for r in range(world)]
    cache.reserve([p[p < n] for p in every])
    pos = every[rank].to(tokens.device)
    full = torch.cat([tokens, tokens.new_zeros(b, padded - n)], dim=1)
    attn = PrefillAttention(cache, pos < n, strategy, group, layout, options)
    logits = model(full[:, pos], pos, attn=attn)  # [B, n_local, V]
    owner = next(r for r in range(world) if bool((every[r] == n - 1).any()))
    last = logits[:, int((pos == n - 1).nonzero()[0])] if rank == owner else None
    return _share_token(last, owner, b, group, tokens.device)


@torch.no_grad()
def decode_step(model, token: torch.Tensor, cache: ShardedKVCache, *, group: Optional[dist.ProcessGroup] = None,
                backend: str = "auto") -> torch.Tensor:
    """Feed ``token [B]`` (the same on every rank) at position ``cache.total``; returns the next
    greedy token ``[B]``, identical on every rank (no token exchange: the merge is the same)."""
    placed = cache.place(1)
    cache.reserve(placed)
    pos = torch.tensor([cache.total - 1], dtype=torch.long, device=token.device)
    attn = CachedAttention(cache, "decode", placed, group, backend)
    return model(token[:, None], pos, attn=attn)[:, -1].argmax(-1)


@torch.no_grad()
def continue_prompt(model, tokens: torch.Tensor, cache: ShardedKVCache, *, group: Optional[dist.ProcessGroup] = None,
                    continuation: str = "auto", backend: str = "auto") -> tuple[torch.Tensor, str]:
    """Append the prompt ``tokens [B, M]`` (the same on every rank) to the cache: each rank runs its
    placed chunk, attending to the whole cache by pass-KV or pass-Q. Returns the next greedy token
    ``[B]`` and the mode used (``"kv"`` or ``"q"``)."""
    group, rank, world = group_context(group)
    b, m = tokens.shape
    placed = cache.place(m)
    lengths_after = [a + int(p.numel()) for a, p in zip(cache.lengths, placed)]
    cfg = model.config
    mode = choose_continuation(continuation, batch=b, max_new_local=max(int(p.numel()) for p in placed),
                               max_shard=max(lengths_after), world_size=world, q_heads=cfg.n_heads,
                               kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                               dtype=model.tok_embeddings.weight.dtype)
    start = cache.total
    mine = cache.reserve(placed).to(tokens.device)
    attn = CachedAttention(cache, mode, placed, group, backend)
    if mine.numel():
        logits = model(tokens[:, mine - start], mine, attn=attn)  # [B, m_rank, V]
    else:  # no new token placed here: run a stand-in token so that every layer meets its collectives
        model(tokens[:, :1], torch.tensor([start], device=tokens.device), attn=attn)
    owner = max(r for r in range(world) if placed[r].numel())
    last = logits[:, -1] if rank == owner else None
    return _share_token(last, owner, b, group, tokens.device), mode

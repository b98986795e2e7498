"""Greedy generation over a sharded KV cache: :func:`generate` (and :func:`continue_generation`).

Every rank calls it with the same model weights and the same prompt. The prompt is prefilled
sharded (any strategy), then tokens are decoded over the cache that stays sharded; the tokens are
the same as single-process generation (greedy).

Bad input raises the same clear error on every rank, never a hang: an empty prompt,
``max_new_tokens < 0``, prompts (or ``max_new_tokens``) that differ between ranks, a cache shard
that would not fit ``kv_budget_bytes``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from ..comm.agree import agree
from ..comm.groups import group_context
from ..config import checksum
from ..layouts.named import layout_or_default
from ..strategies import STRATEGIES
from .cache import ShardedKVCache, kv_bytes
from .steps import continue_prompt, decode_step, padded_length, prefill


@dataclass
class GenerationResult:
    """What :func:`generate` returns on every rank.

    Attributes:
        tokens: the new tokens ``[B, K]`` (int64), the same on every rank.
        first_token_latency_s: wall time of the prefill (prompt in, first token out).
        decode_tokens_per_s: decoded tokens (after the first) per second of decoding; 0 if none.
        cache: this rank's :class:`~burstattn.infer.cache.ShardedKVCache` (to continue).
        continuations: the mode (``"kv"`` / ``"q"``) of each :func:`continue_generation` call.
    """

    tokens: torch.Tensor
    first_token_latency_s: float
    decode_tokens_per_s: float
    cache: ShardedKVCache
    continuations: list = field(default_factory=list)


def _problem(prompt, max_new_tokens) -> Optional[str]:
    if not isinstance(prompt, torch.Tensor) or prompt.dim() != 2 or prompt.dtype not in (torch.int64, torch.int32):
        shape = tuple(prompt.shape) if isinstance(prompt, torch.Tensor) else type(prompt).__name__
        return f"prompt must be an integer tensor [batch, prompt_len], got {shape}"
    if prompt.shape[0] == 0 or prompt.shape[1] == 0:
        return f"the prompt is empty (shape {tuple(prompt.shape)}); give at least one token"
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
        return f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}"
    return None


def prompt_signature(prompt: torch.Tensor, max_new_tokens: int) -> tuple[tuple[str, str], ...]:
    """What every rank must hold alike before generating: the prompt (its shape and a checksum of its
    token ids) and ``max_new_tokens``; compared by :func:`burstattn.comm.agree.agree`."""
    ids = checksum(prompt.detach().to(torch.int64))
    return (("the prompt (shape, token ids)", f"{list(prompt.shape)}, crc32 {ids:08x}"),
            ("max_new_tokens", str(max_new_tokens)))


def generate(model, prompt: torch.Tensor, max_new_tokens: int, *, strategy: str = "burst",
             group: Optional[dist.ProcessGroup] = None, layout: Optional[str] = None, backend: str = "auto",
             kv_budget_bytes: Optional[int] = None, **options) -> GenerationResult:
    """Greedy generation of ``max_new_tokens`` after ``prompt [B, N]`` with :class:`burstattn.models.Llama`.

    Args:
        model: the model (same weights on every rank; ``eval()`` mode is not required: no dropout).
        prompt: int64 ``[B, N]``, the same on every rank; ``N`` need not divide by the group size.
        strategy, layout, options: the prefill's :func:`burstattn.attention` strategy, layout (default:
            the strategy's) and its options; ``backend`` goes to the strategy and to the decode kernels.
        kv_budget_bytes: the most K/V bytes one rank may hold (prompt plus new tokens, all layers);
            checked before any work, the same way on every rank. (The buffers keep spare room of at
            most an eighth of that plus 256 tokens: :func:`~burstattn.infer.cache.append_rows`.)
    Returns:
        :class:`GenerationResult`; with ``max_new_tokens == 0``, no tokens and nothing run.
    """
    fn = "burstattn.infer.generate"
    group, rank, world = group_context(group)
    problem = _problem(prompt, max_new_tokens)
    if problem is None and strategy not in STRATEGIES:
        problem = f"strategy must be one of {sorted(STRATEGIES)}, got {strategy!r}"
    if problem is None and kv_budget_bytes is not None:
        problem = _budget_problem(model, prompt, max_new_tokens, world, layout_or_default(layout),
                                  kv_budget_bytes)
    agree(fn, prompt_signature(prompt, max_new_tokens) if problem is None else (), group, problem=problem)
    cache = ShardedKVCache(rank, world, len(model.layers))
    if max_new_tokens == 0:
        return GenerationResult(prompt.new_zeros(prompt.shape[0], 0), 0.0, 0.0, cache)
    t0 = time.perf_counter()
    token = prefill(model, prompt, cache, strategy=strategy, group=group, layout=layout, backend=backend, **options)
    latency = time.perf_counter() - t0
    tokens, rate = _decode(model, token, cache, max_new_tokens - 1, group, backend)
    return GenerationResult(tokens, latency, rate, cache)


def _decode(model, token: torch.Tensor, cache: ShardedKVCache, steps: int, group, backend: str):
    """``token`` followed by ``steps`` decoded tokens ``[B, steps + 1]``, and the decode rate (tokens/s)."""
    out, t0 = [token], time.perf_counter()
    for _ in range(steps):
        token = decode_step(model, token, cache, group=group, backend=backend)
        out.append(token)
    rate = steps / (time.perf_counter() - t0) if steps else 0.0
    return torch.stack(out, dim=1), rate


def continue_generation(model, result: GenerationResult, prompt: torch.Tensor, max_new_tokens: int, *,
                        group: Optional[dist.ProcessGroup] = None, continuation: str = "auto",
                        backend: str = "auto") -> GenerationResult:
    """Append the last generated token and a further ``prompt [B, M]`` to ``result``'s cache (a
    conversation's next turn), then generate ``max_new_tokens >= 1`` tokens after it. The new prompt
    attends to the whole sharded cache by pass-KV or pass-Q (``continuation``: ``"auto"`` picks
    the one the bytes formula says is cheaper). Returns a new result (its ``tokens`` are the new ones)."""
    fn = "burstattn.infer.continue_generation"
    problem = _problem(prompt, max_new_tokens)
    if problem is None and max_new_tokens < 1:
        problem = f"max_new_tokens must be >= 1 after a continuation prompt, got {max_new_tokens}"
    if problem is None and result.tokens.shape[1] == 0:
        problem = "the result has no generated token to continue from"
    group = group_context(group).group
    agree(fn, prompt_signature(prompt, max_new_tokens) if problem is None else (), group, problem=problem)
    cache = result.cache
    turn = torch.cat([result.tokens[:, -1:], prompt], dim=1)  # the last generated token was never fed
    t0 = time.perf_counter()
    token, mode = continue_prompt(model, turn, cache, group=group, continuation=continuation, backend=backend)
    latency = time.perf_counter() - t0
    tokens, rate = _decode(model, token, cache, max_new_tokens - 1, group, backend)
    return GenerationResult(tokens, latency, rate, cache, result.continuations + [mode])


def _budget_problem(model, prompt, max_new_tokens: int, world: int, layout, budget: int) -> Optional[str]:
    """Why this rank's shard of the K/V would exceed ``budget`` bytes, or ``None``. The prefill
    shard is the layout's (padded) share; decoded tokens fill the shortest shards first."""
    cfg = model.config
    n = int(prompt.shape[1])
    total = n + max(max_new_tokens - 1, 0)
    shard = max(padded_length(n, world, layout) // world, -(-total // world))
    need = kv_bytes(n_layers=cfg.n_layers, batch=int(prompt.shape[0]), tokens=shard, kv_heads=cfg.n_kv_heads,
                    head_dim=cfg.head_dim, dtype=model.tok_embeddings.weight.dtype)
    if need > budget:
        return (f"the K/V cache shard needs {need} bytes per rank ({shard} tokens x {cfg.n_layers} layers) but "
                f"kv_budget_bytes is {budget}: use more ranks or a shorter prompt")
    return None

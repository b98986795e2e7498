"""``burstattn bench infer``: long-prompt inference over a sharded KV cache.

Three suites, each in real local processes (gloo), medians of ``repeats`` after one warm-up:

* ``prefill``: first-token latency (the sharded prefill of :func:`burstattn.infer.steps.prefill`)
  against prompt length for each strategy at world size P, and one process holding everything
  (P=1), on the ``small`` preset. A rank's time is the wall time from a barrier to its first
  token; the figure is the max over ranks.
* ``decode``: decoded tokens per second over a cache of ``decode_cache`` tokens, sharded over P
  ranks against one process holding the whole cache; with the measured bytes per token.
* ``crossover``: a second prompt of M tokens appended to a cache of ``crossover_cache`` tokens by
  pass-KV and by pass-Q (the same M, interleaved), against the bytes formula's choice. Run on the
  ``small`` shape with ONE kv head (GQA 4/1): with multi-head attention the formula always picks
  pass-Q at P=2 (the K/V of the whole cache outweighs the new queries), so there is no crossover to
  measure.

Writes ``infer.json`` / ``infer.md`` (and PNG plots with ``--plots``) under ``--out``.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from burstattn.meter.timing import time_interleaved, time_repeats

SUITES = ("prefill", "decode", "crossover")


@dataclass(frozen=True)
class InferBenchConfig:
    """Flags of ``burstattn bench infer``."""

    model: str = "small"
    world_size: int = 2
    strategies: tuple[str, ...] = ("burst", "ulysses", "tp", "allgather", "rsa")
    prompt_lens: tuple[int, ...] = (1024, 2048, 4096, 8192)
    decode_cache: int = 8192
    decode_tokens: int = 16
    crossover_cache: int = 2048
    crossover_new: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048)
    repeats: int = 3
    suites: tuple[str, ...] = SUITES
    backend: str = "auto"
    seed: int = 0
    out: str = "bench-out"
    usp_options: tuple = ()
    """``(name, value)`` pairs given to ``strategy="usp"`` (``--ulysses-degree`` / ``--ring-degree``)."""


def _model(name: str, seed: int, kv_heads: Optional[int] = None):
    from burstattn.models import Llama, preset

    cfg = preset(name)
    if kv_heads is not None:
        cfg = cfg.with_overrides(n_kv_heads=kv_heads)
    model = Llama(cfg)
    model.init_weights(torch.Generator().manual_seed(seed))
    return model.eval()


def _prompt(n: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed + 1))


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def prefill_rank(rank: int, world: int, cfg: InferBenchConfig, strategies: tuple[str, ...]) -> list[dict]:
    """Per (strategy, N): this rank's first-token times."""
    from burstattn.comm.stats import comm_stats
    from burstattn.infer.cache import ShardedKVCache
    from burstattn.infer.steps import prefill

    model = _model(cfg.model, cfg.seed)
    rows = []
    for n in cfg.prompt_lens:
        prompt = _prompt(n, model.config.vocab_size, cfg.seed)
        for s in strategies:
            def once():
                return prefill(model, prompt, ShardedKVCache(rank, world, model.config.n_layers), strategy=s,
                               backend=cfg.backend, **(dict(cfg.usp_options) if s == "usp" else {}))
            t = time_repeats(once, repeats=cfg.repeats, warmup=1, barrier=_barrier)
            with comm_stats() as stats:
                once()
            rows.append(dict(strategy=s, prompt_len=n, samples=list(t.samples), median_s=t.median,
                             sent_bytes=stats.sent()))
    return rows


def decode_rank(rank: int, world: int, cfg: InferBenchConfig) -> dict:
    """Seconds per decoded token over a cache of ``decode_cache`` tokens, and bytes per token."""
    from burstattn.comm.stats import comm_stats
    from burstattn.infer.cache import ShardedKVCache
    from burstattn.infer.steps import decode_step, prefill

    model = _model(cfg.model, cfg.seed)
    cache = ShardedKVCache(rank, world, model.config.n_layers)
    token = prefill(model, _prompt(cfg.decode_cache, model.config.vocab_size, cfg.seed), cache, backend=cfg.backend)
    token = decode_step(model, token, cache, backend=cfg.backend)  # warm-up
    times = []
    with comm_stats() as stats:
        for _ in range(cfg.decode_tokens):
            _barrier()
            t0 = time.perf_counter()
            token = decode_step(model, token, cache, backend=cfg.backend)
            times.append(time.perf_counter() - t0)
    times.sort()
    return dict(samples=times, median_s=times[len(times) // 2], bytes_per_token=stats.sent() // cfg.decode_tokens,
                cache_bytes=cache.local_bytes())


def crossover_rank(rank: int, world: int, cfg: InferBenchConfig) -> list[dict]:
    """Per M: continuation time by pass-KV and pass-Q, bytes measured, the formula's choice."""
    from burstattn.comm.stats import comm_stats
    from burstattn.infer.cache import ShardedKVCache
    from burstattn.infer.bytes import choose_continuation
    from burstattn.infer.steps import continue_prompt, prefill

    model = _model(cfg.model, cfg.seed, kv_heads=1)
    c = model.config
    base = ShardedKVCache(rank, world, c.n_layers)
    prefill(model, _prompt(cfg.crossover_cache, c.vocab_size, cfg.seed), base, backend=cfg.backend)
    rows = []
    for m in cfg.crossover_new:
        turn = _prompt(m, c.vocab_size, cfg.seed + m)
        fns = {mode: (lambda mode=mode: continue_prompt(model, turn, copy.deepcopy(base), continuation=mode,
                                                        backend=cfg.backend)) for mode in ("kv", "q")}
        t = time_interleaved(fns, repeats=cfg.repeats, warmup=1, barrier=_barrier)
        sent = {}
        for mode, fn in fns.items():
            with comm_stats() as stats:
                fn()
            sent[mode] = stats.sent()
        placed = base.place(m)
        after = [a + int(p.numel()) for a, p in zip(base.lengths, placed)]
        choice = choose_continuation("auto", batch=1, max_new_local=max(int(p.numel()) for p in placed),
                                     max_shard=max(after), world_size=world, q_heads=c.n_heads, kv_heads=c.n_kv_heads,
                                     head_dim=c.head_dim, dtype=torch.float32)
        rows.append(dict(new_tokens=m, median_s={k: v.median for k, v in t.items()}, sent_bytes=sent,
                         formula_choice=choice))
    return rows


def _max_over_ranks(per_rank: list[list[dict]]) -> list[dict]:
    out = []
    for rows in zip(*per_rank):
        row = dict(rows[0])
        row["median_s"] = max(r["median_s"] for r in rows)
        row["sent_bytes"] = max(r["sent_bytes"] for r in rows)
        out.append(row)
    return out


def run_infer(cfg: InferBenchConfig, docs: Optional[str] = None, console=None) -> dict:
    """Run the suites; write ``<out>/infer.json`` and ``infer.md`` (and the tables into ``docs``); return
    the document."""
    from bench.driver import Pools, Started, document, publish
    from bench.infer_report import infer_markdown
    from bench.report import update_document

    started = Started.now()
    prefill, decode, crossover = [], {}, []
    with Pools(timeout_s=7200.0, pg_timeout_s=600.0) as pools:
        pool, single = pools.get(cfg.world_size), pools.get(1)
        if "prefill" in cfg.suites:
            prefill = _max_over_ranks(pool.run(prefill_rank, cfg, cfg.strategies))
            prefill += [dict(r, strategy="single process") for r in single.run(prefill_rank, cfg, ("burst",))[0]]
        if "decode" in cfg.suites:
            decode = {"sharded": pool.run(decode_rank, cfg), "single": single.run(decode_rank, cfg)}
        if "crossover" in cfg.suites:
            per_rank = pool.run(crossover_rank, cfg)
            crossover = [dict(r, median_s={k: max(x["median_s"][k] for x in rows) for k in ("kv", "q")})
                         for r, rows in zip(per_rank[0], zip(*per_rank))]
    doc = document("infer", cfg, started, prefill=prefill, decode=decode, crossover=crossover)
    publish(cfg.out, "infer", doc, infer_markdown(doc), docs, update_document)
    return doc

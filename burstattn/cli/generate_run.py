"""What ``burstattn generate`` runs on every rank: greedy generation over a sharded KV cache.

``--model NAME`` (a preset of :data:`burstattn.models.PRESETS`): the :class:`burstattn.models.Llama`
with random weights from ``--seed`` and, with ``--prompt-len``, a synthetic prompt from the same
seed, so two runs with any world size and strategy produce comparable tokens; generation is
:func:`burstattn.infer.generate.generate` (sharded prefill with ``--strategy``).
``--model DIR`` (a ``save_pretrained`` directory): the transformers model with
``attn_implementation="burst"``, a supported hybrid's mixers patched (:func:`burstattn.hf.patch_mixers`),
and a :class:`burstattn.hf.ShardedCache` (the strategy serves sequence-parallel forwards there; generation
attends the replicated queries to the shards). A model that takes no cache but its own (MiniMax) decodes by
sequence-parallel forwards of the whole sequence so far, one per token (no cache: O(T^2) work in all).

Per rank: first-token latency, decode tokens/s, bytes sent per decoded token (the byte meter) and
peak memory (a separate, profiled run, so the profiler does not distort the timings), after one
untimed warm-up run.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ..comm.stats import comm_stats
from ..meter.memory import measure_peak


@dataclass(frozen=True)
class GenerateConfig:
    """The ``burstattn generate`` flags."""

    model: str = "tiny"
    """A preset name or a save_pretrained directory."""
    world_size: int = 1
    strategy: str = "burst"
    prompt_len: Optional[int] = 64
    """Length of the synthetic prompt (presets; DIR models: random ids below the vocabulary)."""
    prompt_file: Optional[str] = None
    """A text file used as the prompt instead (bytes as token ids, or the directory's tokenizer)."""
    max_new_tokens: int = 16
    seed: int = 0
    backend: str = "auto"
    kv_budget_bytes: Optional[int] = None
    measure_memory: bool = True
    warmup: bool = True
    """Run the whole generation once untimed first (first calls pay one-off setup costs)."""
    threads_per_rank: int = 1
    strategy_options: tuple = ()
    """``(name, value)`` pairs of strategy options (usp's ``ulysses_degree`` / ``ring_degree``)."""


def is_hf_dir(model: str) -> bool:
    return os.path.isdir(model)


def missing_transformers() -> bool:
    """Whether transformers (the ``hf`` extra) cannot be imported here."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return True
    return False


def _prompt(cfg: GenerateConfig, vocab: int, tokenizer_dir: Optional[str] = None) -> torch.Tensor:
    if cfg.prompt_file is not None:
        with open(cfg.prompt_file, "rb") as f:
            data = f.read()
        if tokenizer_dir is not None and os.path.exists(os.path.join(tokenizer_dir, "tokenizer_config.json")):
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(tokenizer_dir)(data.decode(), return_tensors="pt").input_ids
        ids = torch.tensor(list(data), dtype=torch.long)[None]
        if ids.numel() and int(ids.max()) >= vocab:
            raise ValueError(f"--prompt-file: byte {int(ids.max())} is not a token of a {vocab}-token vocabulary")
        return ids
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    return torch.randint(0, vocab, (1, max(cfg.prompt_len or 0, 0)), generator=gen)


def preset_model(name: str, seed: int):
    """The preset's Llama with weights drawn from ``seed`` (independent of the global RNG)."""
    from ..models import Llama, preset

    model = Llama(preset(name))
    model.init_weights(torch.Generator().manual_seed(seed))
    return model.eval()


def _run_preset(cfg: GenerateConfig):
    from ..infer.generate import generate

    model = preset_model(cfg.model, cfg.seed)
    prompt = _prompt(cfg, model.config.vocab_size)

    def once():
        return generate(model, prompt, cfg.max_new_tokens, strategy=cfg.strategy, backend=cfg.backend,
                        kv_budget_bytes=cfg.kv_budget_bytes, **dict(cfg.strategy_options))

    return once, int(prompt.shape[1])


def _run_hf(cfg: GenerateConfig):
    import transformers

    import burstattn.hf as bhf

    from ..comm.agree import agree
    from ..infer.generate import GenerationResult

    bhf.register(strategy=cfg.strategy, backend=cfg.backend, **dict(cfg.strategy_options))
    # built with its own attention, then switched: a family that cannot take "burst" (Falcon builds its
    # attention classes by name) gets check_model's message, not a KeyError from its constructor
    model = transformers.AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32).eval()
    model.set_attn_implementation("burst")
    bhf.patch_mixers(model)  # a supported hybrid's mixers (Gated DeltaNet, Mamba2, lightning attention, ...)
    bhf.check_model(model)  # unsupported mixers, attention outside the interface: its message, before any forward
    prompt = _prompt(cfg, model.config.vocab_size, cfg.model)
    # a model that takes no Cache but its own (MiniMax's): greedy steps by sharded forwards of the whole sequence
    cached = getattr(model, "_supports_default_dynamic_cache", lambda: True)()

    @torch.no_grad()
    def once():
        problem = None
        if prompt.shape[1] == 0:
            problem = "the prompt is empty; give at least one token"
        elif cfg.max_new_tokens < 0:
            problem = f"max_new_tokens must be an int >= 0, got {cfg.max_new_tokens}"
        agree("burstattn generate", [("the prompt length", str(prompt.shape[1])),
                                     ("max_new_tokens", str(cfg.max_new_tokens))], dist.group.WORLD, problem=problem)
        cache = bhf.ShardedCache()
        kw = bhf.cache_kwargs(model, cache)  # `cache` (transformers >= 5.24) or `past_key_values`
        if cfg.max_new_tokens == 0:
            return GenerationResult(prompt[:, :0], 0.0, 0.0, cache)

        def step(ids: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
            if cached:
                return model(input_ids=new, use_cache=True, **kw).logits[:, -1].argmax(-1)
            batch = bhf.shard_batch(ids)
            logits = bhf.gather_logits(model(**batch, use_cache=False).logits, shard=batch["burst_shard"])
            return logits[:, -1].argmax(-1)

        t0 = time.perf_counter()
        with comm_stats():  # its own meter: the caller's counts the decode steps only
            token = step(prompt, prompt)
        t1 = time.perf_counter()
        out, ids = [token], torch.cat([prompt, token[:, None]], 1)
        for _ in range(cfg.max_new_tokens - 1):
            token = step(ids, token[:, None])
            out.append(token)
            ids = torch.cat([ids, token[:, None]], 1)
        t2 = time.perf_counter()
        rate = (cfg.max_new_tokens - 1) / (t2 - t1) if cfg.max_new_tokens > 1 else 0.0
        return GenerationResult(torch.stack(out, dim=1), t1 - t0, rate, cache)

    return once, int(prompt.shape[1])


def generate_rank(rank: int, world: int, cfg: GenerateConfig) -> dict:
    """One rank of ``burstattn generate``: the timed run (byte meter on), then a profiled run for
    peak memory. Returns plain values for the report."""
    once, prompt_len = _run_hf(cfg) if is_hf_dir(cfg.model) else _run_preset(cfg)
    if cfg.warmup:
        once()
    with comm_stats() as stats:
        res = once()
    kv = res.cache.local_bytes()
    peak = measure_peak(once)[1].peak_bytes if cfg.measure_memory else None
    decoded = max(int(res.tokens.shape[1]) - 1, 0)
    return dict(tokens=res.tokens[0].tolist(), first_token_latency_s=res.first_token_latency_s,
                decode_tokens_per_s=res.decode_tokens_per_s, peak_mem_bytes=peak, kv_cache_bytes=kv,
                decode_bytes=stats.sent(op="decode"), decoded=decoded, prompt_len=prompt_len)


def run_generate(cfg: GenerateConfig) -> dict:
    """Run ``burstattn generate`` over ``cfg.world_size`` local ranks; the report (JSON keys)."""
    from ..testing.launch import run_local

    per_rank = run_local(generate_rank, cfg.world_size, cfg, threads_per_rank=cfg.threads_per_rank,
                         timeout_s=3600.0)
    first = per_rank[0]
    decoded = first["decoded"]
    return dict(tokens=first["tokens"],
                first_token_latency_s=max(r["first_token_latency_s"] for r in per_rank),
                decode_tokens_per_s=min(r["decode_tokens_per_s"] for r in per_rank),
                peak_mem_bytes=[r["peak_mem_bytes"] for r in per_rank],
                kv_cache_bytes=[r["kv_cache_bytes"] for r in per_rank],
                bytes_per_token=(first["decode_bytes"] // decoded) if decoded else 0,
                model=cfg.model, world_size=cfg.world_size, strategy=cfg.strategy, prompt_len=first["prompt_len"],
                max_new_tokens=cfg.max_new_tokens, seed=cfg.seed)

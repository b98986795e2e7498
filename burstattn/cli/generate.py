"""``burstattn generate``: greedy generation over a sharded KV cache on local ranks."""
from __future__ import annotations

import argparse
import sys

HELP = "greedy generation over a sharded KV cache on local ranks"


def add_usp_arguments(p: argparse.ArgumentParser) -> None:
    """``--ulysses-degree`` and ``--ring-degree``: the degrees of ``--strategy usp``."""
    p.add_argument("--ulysses-degree", type=int, default=None, metavar="U",
                   help="usp: ranks per Ulysses (all-to-all) group; U x R = the world size")
    p.add_argument("--ring-degree", type=int, default=None, metavar="R", help="usp: ranks per ring")


def usp_options(strategies, ulysses_degree, ring_degree, world_size: int) -> tuple[dict, str]:
    """The strategy options the usp flags give (``{}`` without usp) and what is wrong with them, if anything."""
    usp = "usp" in ([strategies] if isinstance(strategies, str) else list(strategies))
    given = {k: v for k, v in (("ulysses_degree", ulysses_degree), ("ring_degree", ring_degree)) if v is not None}
    if not usp:
        return {}, ("--ulysses-degree and --ring-degree are options of --strategy usp" if given else "")
    if not given:
        return {}, ("--strategy usp needs --ulysses-degree U and/or --ring-degree R (U x R = --world-size "
                    f"{world_size})")
    if any(not isinstance(v, int) or v < 1 for v in given.values()):
        return {}, f"--ulysses-degree and --ring-degree must be positive, got {given}"
    u = given.get("ulysses_degree", world_size // given.get("ring_degree", 1))
    r = given.get("ring_degree", world_size // max(u, 1))
    if u * r != world_size:
        return {}, f"usp: --ulysses-degree x --ring-degree must equal --world-size {world_size}, got {u} x {r}"
    return given, ""


def add(sub: argparse._SubParsersAction) -> None:
    """Add ``burstattn generate`` to the subcommands ``sub``."""
    p = sub.add_parser("generate", help=HELP,
                       description="Prefill the prompt sharded over P local ranks (any strategy), decode over the "
                                   "KV cache that stays sharded; print first-token latency, decode tokens/s, peak "
                                   "memory per rank, bytes per token and the tokens.")
    p.add_argument("--model", default="tiny", metavar="NAME|DIR",
                   help="a model preset (tiny, small, ...: random weights from --seed) or a save_pretrained directory")
    p.add_argument("--world-size", type=int, default=1, metavar="P")
    p.add_argument("--strategy", default="burst", metavar="S", help="prefill strategy (burst, ring, ulysses, ...)")
    add_usp_arguments(p)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt-len", type=int, default=None, metavar="N", help="synthetic prompt of N tokens (--seed)")
    src.add_argument("--prompt-file", default=None, metavar="F", help="prompt text file (bytes as tokens)")
    p.add_argument("--max-new-tokens", type=int, default=16, metavar="K")
    p.add_argument("--seed", type=int, default=0, metavar="X", help="weights and synthetic prompt (presets)")
    p.add_argument("--backend", default="auto", help="local attention kernel")
    p.add_argument("--kv-budget-mb", type=float, default=None, help="refuse if a rank's K/V shard would exceed this")
    p.add_argument("--no-memory", action="store_true", help="skip the profiled peak-memory run")
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up run")
    p.add_argument("--threads-per-rank", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=run)


def run(ns: argparse.Namespace) -> int:
    import json

    from .generate_run import GenerateConfig, run_generate
    from ..testing.launch import LocalGroupError

    if ns.world_size < 1:
        print(f"burstattn generate: --world-size must be >= 1, got {ns.world_size}", file=sys.stderr)
        return 2
    options, problem = usp_options(ns.strategy, ns.ulysses_degree, ns.ring_degree, ns.world_size)
    if problem:
        print(f"burstattn generate: {problem}", file=sys.stderr)
        return 2
    from .generate_run import is_hf_dir, missing_transformers

    if is_hf_dir(ns.model) and missing_transformers():
        print(f"burstattn generate: --model {ns.model} is a Hugging Face directory, which needs transformers: "
              "pip install 'burstattn[hf]'", file=sys.stderr)
        return 2
    budget = None if ns.kv_budget_mb is None else int(ns.kv_budget_mb * 2**20)
    cfg = GenerateConfig(model=ns.model, world_size=ns.world_size, strategy=ns.strategy,
                         prompt_len=ns.prompt_len if ns.prompt_file is None and ns.prompt_len is not None else 64,
                         prompt_file=ns.prompt_file, max_new_tokens=ns.max_new_tokens, seed=ns.seed,
                         backend=ns.backend, kv_budget_bytes=budget, measure_memory=not ns.no_memory,
                         warmup=not ns.no_warmup, threads_per_rank=ns.threads_per_rank,
                         strategy_options=tuple(sorted(options.items())))
    try:
        report = run_generate(cfg)
    except LocalGroupError as e:
        first = e.errors[min(e.errors)] if e.errors else None
        print(f"burstattn generate: {first.message if first else e.summary}", file=sys.stderr)
        return 2
    if ns.json:
        print(json.dumps(report))
        return 0
    mib = [None if b is None else round(b / 2**20, 2) for b in report["peak_mem_bytes"]]
    print(f"model {report['model']}, P={report['world_size']}, strategy {report['strategy']}, "
          f"prompt {report['prompt_len']} tokens")
    print(f"first-token latency {report['first_token_latency_s']:.4f} s; decode {report['decode_tokens_per_s']:.1f} "
          f"tokens/s; bytes sent per token per rank {report['bytes_per_token']}")
    print(f"peak memory per rank (MiB) {mib}; K/V cache per rank (bytes) {report['kv_cache_bytes']}")
    print(f"tokens {report['tokens']}")
    return 0

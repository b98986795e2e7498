"""The inference and Hugging Face subcommands of ``burstattn``: ``generate``, ``bench infer`` and
``bench hf`` (imported only when they run)."""
from __future__ import annotations

import argparse
import sys

from .bench.generate_run import add_usp_arguments, usp_options


def add_generate(sub) -> None:
    """Add ``burstattn generate`` to the subcommands ``sub``."""
    p = sub.add_parser("generate", help="greedy generation over a sharded KV cache on local ranks",
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
    p.set_defaults(handler=run_generate_command)


def run_generate_command(ns: argparse.Namespace) -> int:
    import json

    from .bench.generate_run import GenerateConfig, run_generate
    from .launch import LocalGroupError

    if ns.world_size < 1:
        print(f"burstattn generate: --world-size must be >= 1, got {ns.world_size}", file=sys.stderr)
        return 2
    options, problem = usp_options(ns.strategy, ns.ulysses_degree, ns.ring_degree, ns.world_size)
    if problem:
        print(f"burstattn generate: {problem}", file=sys.stderr)
        return 2
    from .bench.generate_run import is_hf_dir, missing_transformers

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


def run_bench_infer(ns: argparse.Namespace) -> int:
    """``burstattn bench infer``: here, or on the emulated cluster with ``--on-cluster``."""
    from .bench import infer
    from .bench.infer_report import infer_markdown, plot_infer
    from .bench.report import update_document

    options, problem = usp_options(ns.strategies, ns.ulysses_degree, ns.ring_degree, ns.world_size)
    if problem:
        print(f"burstattn bench infer: {problem}", file=sys.stderr)
        return 2
    cfg = infer.replace(infer.config_from_args(ns), usp_options=tuple(sorted(options.items())))
    if ns.on_cluster:
        import json

        from .bench.infer_report import cluster_markdown, infer_markdown_crossover
        from .cluster.infer_bench import run_infer_cluster

        res = run_infer_cluster(ns.on_cluster, nodes=ns.nodes, ranks_per_node=ns.ranks_per_node, model=cfg.model,
                                strategies=cfg.strategies, prompt_lens=cfg.prompt_lens, repeats=cfg.repeats,
                                crossover_cache=cfg.crossover_cache,
                                crossover_new=cfg.crossover_new if "crossover" in cfg.suites else ())
        infer.Path(ns.out).mkdir(parents=True, exist_ok=True)
        (infer.Path(ns.out) / "infer-cluster.json").write_text(json.dumps(res, indent=1, default=str))
        md = cluster_markdown(res, cfg.model)
        if res["crossover"]:
            md += "\n" + infer_markdown_crossover(res, cfg)
        (infer.Path(ns.out) / "infer-cluster.md").write_text(md)
        print(md)
        return 0
    doc = infer.run_infer(cfg)
    md = infer_markdown(doc)
    (infer.Path(ns.out) / "infer.md").write_text(md)
    if ns.docs:
        update_document(ns.docs, md)
    for path in plot_infer(doc, ns.plots) if ns.plots else []:
        print(f"wrote {path}")
    print(md)
    return 0


def run_bench_hf(ns: argparse.Namespace) -> int:
    """``burstattn bench hf``: Trainer steps with and without context parallelism (needs ``burstattn[hf]``)."""
    from .bench import hf
    from .bench.generate_run import missing_transformers
    from .bench.hf_report import hf_markdown, replace_section

    if missing_transformers():
        print("burstattn bench hf: needs transformers and accelerate: pip install 'burstattn[hf]'", file=sys.stderr)
        return 2
    cfg = hf.config_from_args(ns)
    doc = hf.run_hf_bench(cfg)
    md = hf_markdown(doc)
    (hf.Path(cfg.out) / "hf.md").write_text(md)
    if ns.docs:
        replace_section(ns.docs, md)
    print(md)
    return 0

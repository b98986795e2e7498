"""The ``burstattn`` console command.

    burstattn demo [flags]         # spawn local ranks, run + check burst attention on a long sequence
    burstattn bench core [flags]   # overhead, speedup, bytes and memory benchmarks -> JSON + Markdown
    burstattn bench grid --config bench/configs/targets.toml [--plots docs/img]   # strategies + peers
    burstattn bench maxlen --mem-budget MiB [flags]  # longest sequence under a per-rank memory budget
    burstattn bench masks [--quick] [--docs docs/benchmarks.md]  # windows, documents, load balance
    burstattn bench --cluster PRESET|SPEC [flags]   # the strategies on an emulated cluster (root)
    burstattn bench infer [--quick] [--plots DIR] [--docs FILE]   # first-token latency, decode, pass-KV/Q
    burstattn cluster up --nodes N --ranks-per-node R --inter BW[,LAT] --intra BW[,LAT] | --preset NAME
    burstattn cluster down | status | run -- ARGS   # tear down / describe / torchrun ARGS on every node
    burstattn generate --model NAME|DIR --world-size P --strategy S --prompt-len N | --prompt-file F
                       --max-new-tokens K --seed X [--json]   # greedy generation over a sharded KV cache

Subcommands import their modules (and ``rich``) only when they run, so ``burstattn --help`` and
``import burstattn`` stay light. Later subcommands (``train``, ``generate``, ``sim``, ``plan``) are
added to :func:`build_parser` the same way: one ``_add_<name>`` function each.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Optional, Sequence

__all__ = ["build_parser", "main"]


def _add_demo(sub: argparse._SubParsersAction) -> None:
    from . import demo

    p = sub.add_parser("demo", help="run and check burst attention on a long sequence over local ranks",
                       description=demo.__doc__.split("\n\n")[0] if demo.__doc__ else None)
    demo.add_arguments(p)
    p.set_defaults(handler=_run_demo)


def _run_demo(ns: argparse.Namespace) -> int:
    from . import demo

    return demo.run_demo(demo.config_from_args(ns))


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from .bench import core

    p = sub.add_parser("bench", help="benchmarks (JSON + Markdown)")
    p.add_argument("--cluster", default=None, metavar="PRESET|SPEC",
                   help="run the strategies on an emulated cluster (needs root): a preset (a100-pcie-roce, "
                        "h100-nvlink-ib) or 'inter=BW[,LAT];intra=BW[,LAT]'; no SUITE then")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--cluster-seq-len", type=int, default=8192, help="sequence length of the cluster run")
    p.add_argument("--cluster-causal", action="store_true", help="causal attention in the cluster run")
    p.add_argument("--cluster-strategies", nargs="+", default=None)
    p.add_argument("--cluster-repeats", type=int, default=3)
    p.add_argument("--cluster-out", default="bench-out")
    p.add_argument("--cluster-docs", default=None, help="also write the tables into this Markdown file")
    p.set_defaults(handler=_run_bench_cluster)
    suites = p.add_subparsers(dest="suite", metavar="SUITE", required=False)
    c = suites.add_parser("core", help="overhead at world size 1, parallel speedup, bytes sent, peak memory")
    core.add_arguments(c)
    c.set_defaults(handler=_run_bench_core)
    from .bench import grid, maxlen

    g = suites.add_parser("grid", help="strategies and peers x shapes: correctness, time, memory, bytes")
    grid.add_arguments(g)
    g.set_defaults(handler=_run_bench_grid)
    m = suites.add_parser("maxlen", help="longest sequence each strategy fits under a per-rank memory budget")
    maxlen.add_arguments(m)
    m.set_defaults(handler=_run_bench_maxlen)
    from .bench import masks

    k = suites.add_parser("masks", help="sliding window, packed documents and DistFlashAttn balance vs dense causal")
    masks.add_arguments(k)
    k.set_defaults(handler=_run_bench_masks)
    from .bench import infer

    i = suites.add_parser("infer", help="first-token latency per strategy, sharded decoding, pass-KV vs pass-Q")
    infer.add_arguments(i)
    i.set_defaults(handler=_run_bench_infer)


def _run_bench_cluster(ns: argparse.Namespace) -> int:
    if ns.cluster is None:
        print("burstattn bench: give a SUITE (core, grid, maxlen, masks) or --cluster PRESET|SPEC", file=sys.stderr)
        return 2
    from .cluster.bench import STRATEGIES, run_cluster_bench

    run_cluster_bench(ns.cluster, nodes=ns.nodes, ranks_per_node=ns.ranks_per_node, seq_len=ns.cluster_seq_len,
                      causal=ns.cluster_causal, strategies=tuple(ns.cluster_strategies or STRATEGIES),
                      repeats=ns.cluster_repeats, out=ns.cluster_out, docs=ns.cluster_docs)
    return 0


def _add_cluster(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cluster", help="emulated multi-node cluster on this machine (network namespaces, tc)")
    acts = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    up = acts.add_parser("up", help="create the namespaces, links and shaping")
    up.add_argument("--nodes", type=int, default=2)
    up.add_argument("--ranks-per-node", type=int, default=1)
    up.add_argument("--inter", default=None, help="BANDWIDTH[,LATENCY] between nodes, e.g. 10mbit,2ms")
    up.add_argument("--intra", default=None, help="BANDWIDTH[,LATENCY] inside a node, e.g. 100mbit")
    up.add_argument("--preset", default=None, help="a100-pcie-roce or h100-nvlink-ib (calibrated here)")
    up.add_argument("--prefix", default="bt")
    up.set_defaults(handler=_run_cluster)
    for name, text in (("down", "remove everything of the cluster (also after a crash)"),
                       ("status", "describe the cluster that is up")):
        a = acts.add_parser(name, help=text)
        a.add_argument("--prefix", default="bt")
        a.set_defaults(handler=_run_cluster)
    r = acts.add_parser("run", help="torchrun ARGS on every node (e.g. run -- examples/train_step.py)")
    r.add_argument("--prefix", default="bt")
    r.add_argument("--timeout", type=float, default=3600)
    r.add_argument("args", nargs=argparse.REMAINDER)
    r.set_defaults(handler=_run_cluster)


def _run_cluster(ns: argparse.Namespace) -> int:
    from .cluster import netns
    from .cluster.spec import ClusterSpec, parse_link, preset

    try:
        if ns.action == "down":
            removed = netns.down(ns.prefix)
            print(f"removed {len(removed)}: {' '.join(removed) or '(nothing was up)'}")
            return 0
        if ns.action == "status":
            print(netns.load(ns.prefix).describe())
            return 0
        if ns.action == "run":
            from .cluster.launch import run_job

            args = ns.args[1:] if ns.args[:1] == ["--"] else ns.args
            results = run_job(netns.load(ns.prefix), args, timeout_s=ns.timeout)
            for res in results:
                print(f"--- node {res.node} (exit {res.returncode}) ---\n{res.output}")
            return max(1 if r.returncode is None else r.returncode for r in results)
        if ns.preset is not None:
            if ns.inter or ns.intra:
                raise ValueError("give --preset or --inter/--intra, not both")
            from .cluster.spec import calibrate
            world = ns.nodes * ns.ranks_per_node
            spec = preset(ns.preset, ns.nodes, ns.ranks_per_node, calibrate() * min(1.0, (os.cpu_count() or 1) / world))
            spec = netns.up(dataclasses.replace(spec, prefix=ns.prefix), allow_no_latency=True)
        else:
            if not ns.inter or not ns.intra:
                raise ValueError("give --inter BANDWIDTH[,LATENCY] and --intra BANDWIDTH[,LATENCY], or --preset NAME")
            spec = netns.up(ClusterSpec(ns.nodes, ns.ranks_per_node, parse_link(ns.inter), parse_link(ns.intra),
                                        prefix=ns.prefix))
        print(f"up: {spec.describe()}; node addresses {[spec.address(i) for i in range(spec.nodes)]}")
        return 0
    except (ValueError, netns.ClusterError) as e:
        print(f"burstattn cluster: {e}", file=sys.stderr)
        return 2


def _run_bench_core(ns: argparse.Namespace) -> int:
    from .bench import core

    return core.run_core(core.config_from_args(ns))


def _run_bench_grid(ns: argparse.Namespace) -> int:
    from .bench import grid

    cfg = grid.config_from_args(ns)
    records = grid.run_grid(cfg)
    if ns.plots:
        from .bench.plots import plot_grid

        for path in plot_grid(records, ns.plots, stem=cfg.name):
            print(f"wrote {path}")
    return 0


def _run_bench_maxlen(ns: argparse.Namespace) -> int:
    from .bench import maxlen

    return maxlen.run_maxlen(maxlen.config_from_args(ns))


def _run_bench_masks(ns: argparse.Namespace) -> int:
    from .bench import masks

    masks.run_masks(masks.config_from_args(ns))
    return 0


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="greedy generation over a sharded KV cache on local ranks",
                       description="Prefill the prompt sharded over P local ranks (any strategy), decode over the "
                                   "KV cache that stays sharded; print first-token latency, decode tokens/s, peak "
                                   "memory per rank, bytes per token and the tokens.")
    p.add_argument("--model", default="tiny", metavar="NAME|DIR",
                   help="a model preset (tiny, small, ...: random weights from --seed) or a save_pretrained directory")
    p.add_argument("--world-size", type=int, default=1, metavar="P")
    p.add_argument("--strategy", default="burst", metavar="S", help="prefill strategy (burst, ring, ulysses, ...)")
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
    p.set_defaults(handler=_run_generate)


def _run_generate(ns: argparse.Namespace) -> int:
    import json

    from .bench.generate_run import GenerateConfig, run_generate
    from .launch import LocalGroupError

    if ns.world_size < 1:
        print(f"burstattn generate: --world-size must be >= 1, got {ns.world_size}", file=sys.stderr)
        return 2
    budget = None if ns.kv_budget_mb is None else int(ns.kv_budget_mb * 2**20)
    cfg = GenerateConfig(model=ns.model, world_size=ns.world_size, strategy=ns.strategy,
                         prompt_len=ns.prompt_len if ns.prompt_file is None and ns.prompt_len is not None else 64,
                         prompt_file=ns.prompt_file, max_new_tokens=ns.max_new_tokens, seed=ns.seed,
                         backend=ns.backend, kv_budget_bytes=budget, measure_memory=not ns.no_memory,
                         warmup=not ns.no_warmup, threads_per_rank=ns.threads_per_rank)
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


def _run_bench_infer(ns: argparse.Namespace) -> int:
    from .bench import infer
    from .bench.infer_report import infer_markdown, plot_infer
    from .bench.report import update_document

    cfg = infer.config_from_args(ns)
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


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``burstattn`` command."""
    parser = argparse.ArgumentParser(
        prog="burstattn", description="Exact distributed attention over long sequences (BurstAttention).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_demo(sub)
    _add_bench(sub)
    _add_cluster(sub)
    _add_generate(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``burstattn`` console script; returns the exit code."""
    ns = build_parser().parse_args(argv)
    return int(ns.handler(ns) or 0)


if __name__ == "__main__":
    sys.exit(main())

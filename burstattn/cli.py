"""The ``burstattn`` console command.

    burstattn demo [flags]         # spawn local ranks, run + check burst attention on a long sequence
    burstattn bench core [flags]   # overhead, speedup, bytes and memory benchmarks -> JSON + Markdown
    burstattn bench grid --config bench/configs/targets.toml [--plots docs/img]   # strategies + peers
    burstattn bench maxlen --mem-budget MiB [flags]  # longest sequence under a per-rank memory budget
    burstattn bench masks [--quick] [--docs docs/benchmarks.md]  # windows, documents, load balance
    burstattn bench train [--seq-lens ...] [--plots docs/img] [--cluster PRESET]  # training steps: strategies, FSDP, checkpointing
    burstattn bench --cluster PRESET|SPEC [flags]   # the strategies on an emulated cluster (root)
    burstattn bench infer [--quick] [--plots DIR] [--docs FILE]   # first-token latency, decode, pass-KV/Q
    burstattn bench hf [--quick] [--docs docs/hf.md]   # HF Trainer: context parallel vs one process vs DDP
    burstattn cluster up --nodes N --ranks-per-node R --inter BW[,LAT] --intra BW[,LAT] | --preset NAME
    burstattn cluster down | status | run -- ARGS   # tear down / describe / torchrun ARGS on every node
    burstattn sim --model M --seq-len N --gpus G --cluster PRESET --strategy S --mode train|prefill|decode
    burstattn sim calibrate [--out cluster-spec.json]  # this machine as a cluster spec
    burstattn plan --model M --seq-len N --gpus G --cluster PRESET --mode train|prefill [--max-seq-len]
    burstattn train [--config configs/train/X.toml] [flags]  # train a LLaMA model (local ranks or torchrun)
    burstattn generate --model NAME|DIR --world-size P --strategy S --prompt-len N | --prompt-file F
                       --max-new-tokens K --seed X [--json]   # greedy generation over a sharded KV cache

Subcommands import their modules (and ``rich``) only when they run, and ``burstattn --help`` is
answered from :data:`COMMANDS` without importing torch. Later subcommands (``train``, ``generate``, ``sim``, ``plan``) are
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
    from .bench import train as train_bench

    t = suites.add_parser("train", help="training steps: cp strategies vs tp-v1/tp-v3, FSDP, checkpointing modes")
    train_bench.add_arguments(t)
    t.set_defaults(handler=_run_bench_train)
    from .bench import infer

    i = suites.add_parser("infer", help="first-token latency per strategy, sharded decoding, pass-KV vs pass-Q")
    infer.add_arguments(i)
    i.set_defaults(handler=_run_bench_infer)
    from .bench import hf

    h = suites.add_parser("hf", help="Hugging Face Trainer steps on packed long documents: context parallel vs "
                                     "one process vs DDP, longest row under a budget, work balance")
    hf.add_arguments(h)
    h.set_defaults(handler=_run_bench_hf)


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
    up.add_argument("--cluster-spec", default=None, metavar="FILE",
                    help="links from a spec file written by `burstattn sim calibrate`")
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
        if getattr(ns, "cluster_spec", None):
            from .cluster.spec import from_file
            spec = netns.up(from_file(ns.cluster_spec, prefix=ns.prefix), allow_no_latency=True)
            print(f"up: {spec.describe()}; node addresses {[spec.address(i) for i in range(spec.nodes)]}")
            return 0
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


def _add_sim(sub: argparse._SubParsersAction) -> None:
    from .sim import cli as sim_cli

    p = sub.add_parser("sim", help="simulate a strategy on a cluster (time, memory, timeline); `sim calibrate`")
    sim_cli.add_sim_arguments(p)
    p.set_defaults(handler=lambda ns: sim_cli.run_sim(ns))
    q = sub.add_parser("plan", help="rank every strategy and degree choice on a cluster; --max-seq-len")
    sim_cli.add_plan_arguments(q)
    q.set_defaults(handler=lambda ns: sim_cli.run_plan(ns))


def _run_bench_train(ns: argparse.Namespace) -> int:
    from .bench import train as train_bench

    cfg = train_bench.config_from_args(ns)
    if ns.cluster is None:
        train_bench.run_train_bench(cfg)
        return 0
    from .cluster.train_bench import run_train_cluster

    doc = run_train_cluster(cfg, ns.cluster, nodes=ns.nodes, ranks_per_node=ns.ranks_per_node)
    train_bench.write_report(doc, cfg, name="train-cluster")
    return 0


def _add_train(sub: argparse._SubParsersAction) -> None:
    from .cli_train import add_train

    add_train(sub)


def _add_generate(sub: argparse._SubParsersAction) -> None:
    from .cli_generate import add_generate

    add_generate(sub)


def _run_bench_hf(ns: argparse.Namespace) -> int:
    from .cli_generate import run_bench_hf

    return run_bench_hf(ns)


def _run_bench_infer(ns: argparse.Namespace) -> int:
    from .cli_generate import run_bench_infer

    return run_bench_infer(ns)


DESCRIPTION = "Exact distributed attention over long sequences (BurstAttention)."
# name -> one line, for ``burstattn --help`` (answered without importing torch or any subcommand);
# a new subcommand adds its line here as well as its ``_add_<name>`` (tests check both agree)
COMMANDS = {
    "demo": "run and check burst attention on a long sequence over local ranks",
    "bench": "benchmarks (JSON + Markdown)",
    "cluster": "emulated multi-node cluster on this machine (network namespaces, tc)",
    "sim": "simulate a strategy on a cluster (time, memory, timeline); `sim calibrate`",
    "plan": "rank every strategy and degree choice on a cluster; --max-seq-len",
    "train": "train a LLaMA-style model with sequence / tensor parallelism",
    "generate": "greedy generation over a sharded KV cache on local ranks",
}


def light_parser() -> argparse.ArgumentParser:
    """The top level of the command (names and one-line helps only): what ``burstattn --help`` prints."""
    parser = argparse.ArgumentParser(prog="burstattn", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, text in COMMANDS.items():
        sub.add_parser(name, help=text, add_help=False)
    return parser


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``burstattn`` command."""
    parser = argparse.ArgumentParser(prog="burstattn", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_demo(sub)
    _add_bench(sub)
    _add_cluster(sub)
    _add_sim(sub)
    _add_train(sub)
    _add_generate(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``burstattn`` console script; returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        light_parser().parse_args(args)  # prints the help (or the usage error) and exits
    ns = build_parser().parse_args(args)
    return int(ns.handler(ns) or 0)


if __name__ == "__main__":
    sys.exit(main())

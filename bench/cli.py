"""``python -m bench`` (also ``burstattn bench``, forwarded from a source checkout): every suite's flags
and handler, ``--cluster`` and the emulated cluster's ``cluster up | down | status | run``.

    burstattn bench core [flags]   # overhead, speedup, bytes and memory benchmarks -> JSON + Markdown
    burstattn bench grid --config bench/configs/targets.toml [--plots docs/img]   # strategies + peers
    burstattn bench maxlen --mem-budget MiB [flags]  # longest sequence under a per-rank memory budget
    burstattn bench masks [--quick] [--docs bench/results/masks.md]  # windows, documents, load balance
    burstattn bench train [--seq-lens ...] [--plots docs/img] [--cluster PRESET]  # training steps
    burstattn bench infer [--quick] [--plots DIR] [--docs FILE] [--cluster PRESET]  # prefill, decode, pass-KV/Q
    burstattn bench hf [--quick] [--docs docs/hf.md]   # HF Trainer: context parallel vs one process vs DDP
    burstattn bench partition [--seq-len N] [--docs docs/partition.md]  # mask_partition vs fixed layouts
    burstattn bench --cluster PRESET|SPEC [flags]   # the attention strategies on an emulated cluster (root)
    burstattn cluster up | down | status | run ...  # = python -m bench cluster ...

``--cluster PRESET|SPEC`` means one thing everywhere: run on the emulated cluster (needs root).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Optional, Sequence

HELP = "benchmarks (JSON + Markdown)"
# suite -> (one line, flags, handler)
SUITE_HELP = {
    "core": "overhead at world size 1, parallel speedup, bytes sent, peak memory",
    "grid": "strategies and peers x shapes: correctness, time, memory, bytes",
    "maxlen": "longest sequence each strategy fits under a per-rank memory budget",
    "masks": "sliding window, packed documents and DistFlashAttn balance vs dense causal",
    "train": "training steps: cp strategies vs tp-v1/tp-v3, FSDP, checkpointing modes",
    "infer": "first-token latency per strategy, sharded decoding, pass-KV vs pass-Q",
    "partition": "mask_partition vs zigzag/striped/contiguous: work balance, bytes, slowest rank's CPU s",
    "dispatch": "dynamic vs static dispatch of long-tailed documents: slowest rank's CPU s (or --simulate)",
    "hf": "Hugging Face Trainer steps on packed long documents: context parallel vs one process vs DDP, "
          "longest row under a budget, work balance",
}


def main(argv: Optional[Sequence[str]] = None, prog: str = "python -m bench") -> int:
    """Parse ``argv`` (default: the command line) and run the suite or cluster action; the exit code."""
    ns = build_parser(prog).parse_args(argv)
    try:
        return int(ns.handler(ns) or 0)
    except KeyboardInterrupt:  # Ctrl-C: one line (local ranks ignore SIGINT; their launcher stops them)
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


def build_parser(prog: str = "python -m bench") -> argparse.ArgumentParser:
    """The parser of the bench command: its suites, ``--cluster`` and the ``cluster`` actions."""
    p = argparse.ArgumentParser(prog=prog, description=HELP)
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
    suites = p.add_subparsers(dest="suite", metavar="SUITE", required=False)
    from bench.cli_hf import add_hf_arguments, run_hf
    from bench.partition_balance import add_arguments as add_partition_arguments, run_cli as run_partition
    from bench.dispatch_balance import add_arguments as add_dispatch_arguments, run_cli as run_dispatch

    handlers = {"core": run_core, "grid": run_grid, "maxlen": run_maxlen, "masks": run_masks, "train": run_train,
                "infer": run_infer, "hf": run_hf,
                "partition": run_partition, "dispatch": run_dispatch}
    flags = {"core": add_core_arguments, "grid": add_grid_arguments, "maxlen": add_maxlen_arguments,
             "masks": add_masks_arguments, "train": add_train_arguments, "infer": add_infer_arguments,
             "hf": add_hf_arguments, "partition": add_partition_arguments, "dispatch": add_dispatch_arguments}
    for name, text in SUITE_HELP.items():
        s = suites.add_parser(name, help=text)
        flags[name](s)
        s.set_defaults(handler=guarded(handlers[name], name))
    from bench.cluster.cli import add as add_cluster

    add_cluster(suites)
    p.set_defaults(handler=guarded(run_cluster, None))
    return p


def guarded(handler, suite):
    """``handler`` with bad input as one line: a ``--cluster`` value that names no preset, spec file or
    ``inter=...;intra=...`` pair is refused before anything is measured; any ``ValueError`` (a flag's
    value) prints ``burstattn bench [SUITE]: error: ...`` and exits 2."""
    def run(ns: argparse.Namespace) -> int:
        try:
            if getattr(ns, "cluster", None):
                check_cluster(ns.cluster, getattr(ns, "nodes", 2), getattr(ns, "ranks_per_node", 2))
            return handler(ns)
        except ValueError as exc:
            print(f"burstattn bench{' ' + suite if suite else ''}: error: {exc}", file=sys.stderr)
            return 2
    return run


def check_cluster(text: str, nodes: int, ranks_per_node: int) -> None:
    """``ValueError`` naming ``--cluster`` unless ``text`` resolves to a cluster (no calibration run)."""
    from bench.cluster.spec import resolve

    try:
        resolve(text, nodes, ranks_per_node, local_flops=1.0)
    except ValueError as exc:
        raise ValueError(f"--cluster {text!r}: {exc}") from None


def run_cluster(ns: argparse.Namespace) -> int:
    """``burstattn bench --cluster PRESET|SPEC`` (no suite): the attention strategies on the cluster."""
    if ns.cluster is None:
        print(f"burstattn bench: give a SUITE ({', '.join(SUITE_HELP)}) or --cluster PRESET|SPEC", file=sys.stderr)
        return 2
    from bench.cluster.bench import STRATEGIES, run_cluster_bench

    run_cluster_bench(ns.cluster, nodes=ns.nodes, ranks_per_node=ns.ranks_per_node, seq_len=ns.cluster_seq_len,
                      causal=ns.cluster_causal, strategies=tuple(ns.cluster_strategies or STRATEGIES),
                      repeats=ns.cluster_repeats, out=ns.cluster_out, docs=ns.cluster_docs)
    return 0


def run_core(ns: argparse.Namespace) -> int:
    from bench import core

    return core.run_core(core_config(ns))


def run_grid(ns: argparse.Namespace) -> int:
    from bench import grid

    cfg = grid_config(ns)
    records = grid.run_grid(cfg)
    if ns.plots:
        from bench.plots import plot_grid

        for path in plot_grid(records, ns.plots, stem=cfg.name):
            print(f"wrote {path}")
    return 0


def run_maxlen(ns: argparse.Namespace) -> int:
    from bench import maxlen

    return maxlen.run_maxlen(maxlen_config(ns))


def run_masks(ns: argparse.Namespace) -> int:
    from bench import masks

    masks.run_masks(masks_config(ns))
    return 0


def run_train(ns: argparse.Namespace) -> int:
    from bench import train as train_bench

    if ns.max_len:
        from bench.train_maxlen import MaxLenConfig, run_maxlen

        for flag in ("budget_mb", "mlp_chunk", "loss_chunk", "max_len_start", "max_len_granule"):
            if getattr(ns, flag) <= 0 and not (flag.endswith("chunk") and getattr(ns, flag) == 0):
                print(f"burstattn bench train: --{flag.replace('_', '-')} must be positive", file=sys.stderr)
                return 2
        run_maxlen(MaxLenConfig(budget_mb=ns.budget_mb, model=ns.max_len_model, world_size=ns.world_size,
                                threads=ns.threads, contenders=tuple(ns.max_len_contenders), mlp_chunk=ns.mlp_chunk,
                                loss_chunk=ns.loss_chunk, start=ns.max_len_start, cap=ns.max_len_cap,
                                granule=ns.max_len_granule, bisect_steps=ns.bisect_steps, time_len=ns.time_len,
                                repeats=ns.repeats, out=ns.out, plots=ns.plots))
        return 0

    cfg = train_config(ns)
    if ns.cluster is None:
        train_bench.run_train_bench(cfg)
        return 0
    from bench.cluster.train_bench import run_train_cluster

    doc = run_train_cluster(cfg, ns.cluster, nodes=ns.nodes, ranks_per_node=ns.ranks_per_node)
    train_bench.write_report(doc, cfg, name="train-cluster")
    return 0


def run_infer(ns: argparse.Namespace) -> int:
    """``burstattn bench infer``: here, or on the emulated cluster with ``--cluster``."""
    from bench import infer
    from bench.infer_report import infer_markdown, plot_infer

    from burstattn.cli.generate import usp_options

    options, problem = usp_options(ns.strategies, ns.ulysses_degree, ns.ring_degree, ns.world_size)
    if problem:
        print(f"burstattn bench infer: {problem}", file=sys.stderr)
        return 2
    cfg = dataclasses.replace(infer_config(ns), usp_options=tuple(sorted(options.items())))
    if ns.cluster:
        from bench.driver import publish
        from bench.infer_report import cluster_markdown, infer_markdown_crossover
        from bench.cluster.infer_bench import run_infer_cluster

        res = run_infer_cluster(ns.cluster, nodes=ns.nodes, ranks_per_node=ns.ranks_per_node, model=cfg.model,
                                strategies=cfg.strategies, prompt_lens=cfg.prompt_lens, repeats=cfg.repeats,
                                crossover_cache=cfg.crossover_cache,
                                crossover_new=cfg.crossover_new if "crossover" in cfg.suites else ())
        md = cluster_markdown(res, cfg.model)
        if res["crossover"]:
            md += "\n" + infer_markdown_crossover(res, cfg)
        print(md)
        publish(ns.out, "infer-cluster", res, md)
        return 0
    doc = infer.run_infer(cfg, docs=ns.docs)
    print(infer_markdown(doc))
    for path in plot_infer(doc, ns.plots) if ns.plots else []:
        print(f"wrote {path}")
    return 0


def add_core_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``burstattn bench core``."""
    from bench.core import CoreConfig

    d = CoreConfig()
    p.add_argument("--out", default=d.out, help="output directory (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="small sizes and fewer repeats (smoke run)")
    p.add_argument("--docs", default=None, metavar="FILE",
                   help="also write the tables into FILE (e.g. bench/results/core.md), keeping its reading")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="sequence length of overhead/speedup points")
    p.add_argument("--repeats", type=int, default=d.repeats)
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--suites", nargs="+", choices=d.suites, default=list(d.suites),
                   help="which suites to run (default: all)")
    p.add_argument("--partials-seq-len", type=int, default=d.partials_seq_len,
                   help="sequence length of the float32-partials points (default: %(default)s)")


def core_config(ns: argparse.Namespace) -> CoreConfig:
    """A :class:`CoreConfig` from parsed flags."""
    from bench.core import CoreConfig

    return CoreConfig(out=ns.out, docs=ns.docs, quick=ns.quick, seq_len=ns.seq_len, repeats=ns.repeats,
                      warmup=ns.warmup, suites=tuple(ns.suites), partials_seq_len=ns.partials_seq_len)


def add_grid_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``burstattn bench grid`` (override the config file)."""
    p.add_argument("--config", default=None, metavar="FILE", help="TOML config (bench/configs/*.toml)")
    p.add_argument("--contenders", nargs="+", default=None, help="e.g. burst ring torch_cp:allgather")
    p.add_argument("--seq-lens", nargs="+", type=int, default=None)
    p.add_argument("--world-sizes", nargs="+", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--out", default=None, help="output directory")
    p.add_argument("--name", default=None, help="output file stem")
    p.add_argument("--plots", default=None, metavar="DIR", help="also write PNG plots into DIR")


def grid_config(ns: argparse.Namespace) -> GridConfig:
    from bench.grid import GridConfig

    return GridConfig.load(ns.config, contenders=ns.contenders, seq_lens=ns.seq_lens, world_sizes=ns.world_sizes,
                           repeats=ns.repeats, out=ns.out, name=ns.name)


def add_maxlen_arguments(p: argparse.ArgumentParser) -> None:
    from bench.grid import OURS
    from bench.maxlen import MaxlenConfig

    d = MaxlenConfig()
    p.add_argument("--mem-budget", type=float, default=d.mem_budget_mib, metavar="MiB",
                   help="per-rank budget for the measured peak of one fwd+bwd (default: %(default)s)")
    p.add_argument("--contenders", nargs="+", default=list(d.contenders),
                   help=f"ours ({', '.join(OURS)}) and peers as peer:variant")
    p.add_argument("--world-size", type=int, default=d.world_size)
    p.add_argument("--non-causal", action="store_true")
    p.add_argument("--start", type=int, default=d.start)
    p.add_argument("--cap", type=int, default=d.cap)
    p.add_argument("--bisect-steps", type=int, default=d.bisect_steps)
    p.add_argument("--out", default=d.out)


def maxlen_config(ns: argparse.Namespace) -> MaxlenConfig:
    from bench.maxlen import MaxlenConfig

    return dataclasses.replace(MaxlenConfig(), mem_budget_mib=ns.mem_budget, contenders=tuple(ns.contenders),
                   world_size=ns.world_size, causal=not ns.non_causal, start=ns.start, cap=ns.cap,
                   bisect_steps=ns.bisect_steps, out=ns.out)


def add_masks_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``burstattn bench masks``."""
    from bench.masks import SUITES, MasksConfig

    d = MasksConfig()
    p.add_argument("--out", default=d.out, help="output directory (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="N=1024, P<=4, 1 repeat: a smoke run (not for the docs)")
    p.add_argument("--docs", default=None, metavar="FILE",
                   help="also write the section into FILE (e.g. bench/results/masks.md), keeping its '### Reading'")
    p.add_argument("--suites", nargs="+", choices=SUITES, default=list(d.suites))
    p.add_argument("--world-size", type=int, default=d.world_size, help="ranks of the masks suite")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="N of the masks suite")
    p.add_argument("--distflash-world-sizes", nargs="+", type=int, default=list(d.distflash_world_sizes))
    p.add_argument("--distflash-seq-len", type=int, default=d.distflash_seq_len)
    p.add_argument("--documents", type=int, default=d.documents)
    p.add_argument("--doc-seed", type=int, default=d.doc_seed)
    p.add_argument("--repeats", type=int, default=d.repeats)
    p.add_argument("--warmup", type=int, default=d.warmup)


def masks_config(ns: argparse.Namespace) -> MasksConfig:
    """A :class:`MasksConfig` from parsed flags."""
    from bench.masks import MasksConfig

    return MasksConfig(out=ns.out, docs=ns.docs, quick=ns.quick, suites=tuple(ns.suites), world_size=ns.world_size,
                       seq_len=ns.seq_len, distflash_world_sizes=tuple(ns.distflash_world_sizes),
                       distflash_seq_len=ns.distflash_seq_len, documents=ns.documents, doc_seed=ns.doc_seed,
                       repeats=ns.repeats, warmup=ns.warmup)


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    from bench.train import TrainBenchConfig

    d = TrainBenchConfig()
    p.add_argument("--model", default=d.model)
    p.add_argument("--seq-lens", type=int, nargs="+", default=list(d.seq_lens))
    p.add_argument("--strategies", nargs="*", default=list(d.strategies),
                   help="contenders of the sweep (none: only the checkpointing modes)")
    p.add_argument("--no-fsdp-sweep", action="store_true", help="only without FSDP")
    p.add_argument("--mode-seq-len", type=int, default=0)
    p.add_argument("--mode-strategies", nargs="*", default=list(d.mode_strategies))
    p.add_argument("--batch", type=int, default=d.batch)
    p.add_argument("--world-size", type=int, default=d.world_size)
    p.add_argument("--threads", type=int, default=d.threads)
    p.add_argument("--repeats", type=int, default=d.repeats)
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--out", default=d.out)
    p.add_argument("--plots", default=None, help="directory of the PNG plots")
    p.add_argument("--curve", default=None, help="a `burstattn train --metrics` file to plot")
    p.add_argument("--cluster", default=None, metavar="PRESET|SPEC",
                   help="run on an emulated cluster (needs root): a preset (a100-pcie-roce, ...), "
                        "'inter=BW[,LAT];intra=BW[,LAT]' or a spec file; writes train-cluster.json/.md")
    p.add_argument("--nodes", type=int, default=2, help="emulated nodes (with --cluster)")
    p.add_argument("--ranks-per-node", type=int, default=2, help="ranks per emulated node (with --cluster)")
    from bench.train_maxlen import CONTENDERS, MaxLenConfig

    m = MaxLenConfig()
    g = p.add_argument_group("--max-len: the longest trainable context under a memory budget")
    g.add_argument("--max-len", action="store_true",
                   help="bisect, per contender, the longest --seq-len whose step fits --budget-mb (real steps)")
    g.add_argument("--budget-mb", type=float, default=m.budget_mb, help="per-rank allocator peak budget, MiB")
    g.add_argument("--max-len-contenders", nargs="+", default=list(m.contenders), choices=sorted(CONTENDERS),
                   metavar="NAME", help=f"of {sorted(CONTENDERS)}")
    g.add_argument("--max-len-model", default=m.model)
    g.add_argument("--max-len-start", type=int, default=m.start)
    g.add_argument("--max-len-cap", type=int, default=m.cap)
    g.add_argument("--max-len-granule", type=int, default=m.granule)
    g.add_argument("--bisect-steps", type=int, default=m.bisect_steps)
    g.add_argument("--mlp-chunk", type=int, default=m.mlp_chunk, metavar="TOKENS", help="the blockwise contenders'")
    g.add_argument("--loss-chunk", type=int, default=m.loss_chunk, metavar="TOKENS", help="the blockwise contenders'")
    g.add_argument("--time-len", type=int, default=0,
                   help="length of the side-by-side step timing (0: the longest all fit, at most 8192)")


def train_config(ns: argparse.Namespace) -> TrainBenchConfig:
    from bench.train import TrainBenchConfig

    return TrainBenchConfig(model=ns.model, seq_lens=tuple(ns.seq_lens), strategies=tuple(ns.strategies),
                            fsdp=(False,) if ns.no_fsdp_sweep else (False, True), mode_seq_len=ns.mode_seq_len,
                            mode_strategies=tuple(ns.mode_strategies), batch=ns.batch, world_size=ns.world_size,
                            threads=ns.threads, repeats=ns.repeats, warmup=ns.warmup, out=ns.out, plots=ns.plots,
                            curve=ns.curve)


def add_infer_arguments(p: argparse.ArgumentParser) -> None:
    from bench.infer import SUITES, InferBenchConfig

    d = InferBenchConfig()
    p.add_argument("--model", default=d.model)
    p.add_argument("--world-size", type=int, default=d.world_size)
    p.add_argument("--strategies", nargs="+", default=list(d.strategies))
    p.add_argument("--prompt-lens", nargs="+", type=int, default=list(d.prompt_lens))
    p.add_argument("--decode-cache", type=int, default=d.decode_cache)
    p.add_argument("--decode-tokens", type=int, default=d.decode_tokens)
    p.add_argument("--crossover-cache", type=int, default=d.crossover_cache)
    p.add_argument("--crossover-new", nargs="+", type=int, default=list(d.crossover_new))
    p.add_argument("--repeats", type=int, default=d.repeats)
    p.add_argument("--suites", nargs="+", default=list(d.suites), choices=SUITES)
    p.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run in seconds)")
    p.add_argument("--out", default=d.out)
    p.add_argument("--plots", default=None, metavar="DIR", help="write PNG plots here")
    p.add_argument("--docs", default=None, metavar="FILE", help="also write the tables into this Markdown file")
    p.add_argument("--cluster", "--on-cluster", dest="cluster", default=None, metavar="PRESET|SPEC",
                   help="instead: the prefill suite on an emulated cluster (root), e.g. a100-pcie-roce")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=1)
    from burstattn.cli.generate import add_usp_arguments

    add_usp_arguments(p)


def infer_config(ns: argparse.Namespace) -> InferBenchConfig:
    from bench.infer import InferBenchConfig

    cfg = dataclasses.replace(InferBenchConfig(), model=ns.model, world_size=ns.world_size, strategies=tuple(ns.strategies),
                  prompt_lens=tuple(ns.prompt_lens), decode_cache=ns.decode_cache, decode_tokens=ns.decode_tokens,
                  crossover_cache=ns.crossover_cache, crossover_new=tuple(ns.crossover_new), repeats=ns.repeats,
                  suites=tuple(ns.suites), out=ns.out)
    if ns.quick:
        cfg = dataclasses.replace(cfg, model="tiny", prompt_lens=(64, 128), decode_cache=128, decode_tokens=4,
                      crossover_cache=64, crossover_new=(8, 64), repeats=1)
    return cfg

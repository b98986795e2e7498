"""The ``burstattn`` console command.

    burstattn demo [flags]         # spawn local ranks, run + check burst attention on a long sequence
    burstattn bench core [flags]   # overhead, speedup, bytes and memory benchmarks -> JSON + Markdown
    burstattn bench grid --config bench/configs/targets.toml [--plots docs/img]   # strategies + peers
    burstattn bench maxlen --mem-budget MiB [flags]  # longest sequence under a per-rank memory budget
    burstattn bench masks [--quick] [--docs docs/benchmarks.md]  # windows, documents, load balance

Subcommands import their modules (and ``rich``) only when they run, so ``burstattn --help`` and
``import burstattn`` stay light. Later subcommands (``train``, ``generate``, ``sim``, ``plan``) are
added to :func:`build_parser` the same way: one ``_add_<name>`` function each.
"""
from __future__ import annotations

import argparse
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
    suites = p.add_subparsers(dest="suite", metavar="SUITE", required=True)
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


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``burstattn`` command."""
    parser = argparse.ArgumentParser(
        prog="burstattn", description="Exact distributed attention over long sequences (BurstAttention).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_demo(sub)
    _add_bench(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``burstattn`` console script; returns the exit code."""
    ns = build_parser().parse_args(argv)
    return int(ns.handler(ns) or 0)


if __name__ == "__main__":
    sys.exit(main())

"""The ``burstattn`` console command: one module per command, every parser in this package.

    burstattn demo [flags]         # spawn local ranks, run + check burst attention on a long sequence
    burstattn bench SUITE [flags]  # core | grid | maxlen | ... : forwarded to the repository's bench/
    burstattn bench --cluster PRESET|SPEC [flags]   # the strategies on an emulated cluster (root)
    burstattn cluster up --nodes N --ranks-per-node R --inter BW[,LAT] --intra BW[,LAT] | --preset NAME
    burstattn cluster down | status | run -- ARGS   # tear down / describe / torchrun ARGS on every node
    burstattn sim --model M --seq-len N --gpus G --cluster PRESET --strategy S --mode train|prefill|decode
    burstattn sim calibrate [--out cluster-spec.json]  # this machine as a cluster spec
    burstattn plan --model M --seq-len N --gpus G --cluster PRESET --mode train|prefill [--max-seq-len]
    burstattn train [--config configs/train/X.toml] [flags]  # train a LLaMA model (local ranks or torchrun)
    burstattn generate --model NAME|DIR --world-size P --strategy S --prompt-len N | --prompt-file F
                       --max-new-tokens K --seed X [--json]   # greedy generation over a sharded KV cache

``burstattn --help`` is answered from :data:`COMMANDS` without importing torch or any command's
module; a command's module (and with it torch, ``rich``) is imported only when it runs.
Under torchrun: ``torchrun ... -m burstattn.cli train ...``.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional, Sequence

from . import forward
from .forward import FORWARDED

__all__ = ["COMMANDS", "build_parser", "light_parser", "main"]

DESCRIPTION = "Exact distributed attention over long sequences (BurstAttention)."
# name -> (module of this package whose ``add(sub)`` adds it, one line for ``burstattn --help``);
# a module may add several commands (sim adds sim and plan). Tests check this table against the parser.
COMMANDS = {
    "demo": ("demo", "run and check burst attention on a long sequence over local ranks"),
    "bench": ("forward", "benchmarks (JSON + Markdown), from a source checkout (the repository's bench/)"),
    "cluster": ("forward", "emulated multi-node cluster on this machine (network namespaces, tc), from a checkout"),
    "sim": ("sim", "simulate a strategy on a cluster (time, memory, timeline); `sim calibrate`"),
    "plan": ("sim", "rank every strategy and degree choice on a cluster; --max-seq-len"),
    "train": ("train", "train a LLaMA-style model with sequence / tensor parallelism"),
    "generate": ("generate", "greedy generation over a sharded KV cache on local ranks"),
}


def light_parser() -> argparse.ArgumentParser:
    """The top level of the command (names and one-line helps only): what ``burstattn --help`` prints."""
    parser = argparse.ArgumentParser(prog="burstattn", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_, text) in COMMANDS.items():
        sub.add_parser(name, help=text, add_help=False)
    return parser


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``burstattn`` command (every command's flags)."""
    parser = argparse.ArgumentParser(prog="burstattn", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in dict.fromkeys(m for m, _ in COMMANDS.values()):
        importlib.import_module(f".{module}", __name__).add(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``burstattn`` console script; returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        light_parser().parse_args(args)  # prints the help (or the usage error) and exits
    if args[0] in FORWARDED:  # measurement lives in the repository's bench/: its arguments go as given
        return forward.run(args[0], args[1:])
    ns = build_parser().parse_args(args)
    try:
        return int(ns.handler(ns) or 0)
    except KeyboardInterrupt:  # Ctrl-C: one line (local ranks ignore SIGINT; their launcher stops them)
        print(f"burstattn {ns.command}: interrupted", file=sys.stderr)
        return 130

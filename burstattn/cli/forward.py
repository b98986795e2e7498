"""``burstattn bench ...`` and ``burstattn cluster ...``: measurement lives outside the installed package,
in the repository's ``bench/`` (``python -m bench ...``); these two commands forward their arguments,
as given, to it, from a source checkout (the ``bench/`` beside this ``burstattn`` package)."""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import Optional, Sequence

FORWARDED = ("bench", "cluster")  # their one-line helps: burstattn.cli.COMMANDS


def add(sub: argparse._SubParsersAction) -> None:
    """Add the forwarded commands to ``sub`` (for the help and the command table; :func:`run` parses them)."""
    from . import COMMANDS

    for name in FORWARDED:
        p = sub.add_parser(name, help=COMMANDS[name][1], add_help=False)
        p.add_argument("args", nargs=argparse.REMAINDER, help="the arguments of python -m bench " +
                       ("" if name == "bench" else "cluster ") + "...")
        p.set_defaults(handler=lambda ns, name=name: run(name, ns.args))


def bench_package(root: Optional[Path] = None):
    """The repository's ``bench`` package beside this ``burstattn`` (``root``: the checkout), imported;
    ``None`` when there is none (an installed wheel) or another ``bench`` module shadows it."""
    root = (root or Path(__file__).resolve().parents[2]).resolve()
    if not (root / "bench" / "__init__.py").is_file():
        return None
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))  # spawned ranks inherit it: they import the suites' functions
    mod = importlib.import_module("bench")
    return mod if Path(mod.__file__).resolve().parent == root / "bench" else None


def run(command: str, argv: Sequence[str]) -> int:
    """Run ``burstattn COMMAND ARGV`` through the repository's bench command; the exit code."""
    if bench_package() is None:
        print(f"burstattn {command}: needs a source checkout of burstattn (its bench/ is not installed): "
              f"run `python -m bench {'cluster ' if command == 'cluster' else ''}...` from the repository root",
              file=sys.stderr)
        return 2
    from bench.cli import main

    if command == "cluster":
        return main(["cluster", *argv], prog="burstattn")
    return main(list(argv), prog="burstattn bench")

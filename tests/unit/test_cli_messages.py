"""One-line messages of the command line: `bench` without a suite names every suite, a bad
`--cluster` is one line before anything is measured, Ctrl-C is one line."""
from __future__ import annotations

import argparse

import pytest

import burstattn.cli as cli
from burstattn.cli import build_parser, main


def _suites() -> list[str]:
    from bench.cli import SUITE_HELP, build_parser as bench_parser

    sub = next(a for a in bench_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert set(SUITE_HELP) <= set(sub.choices)
    return list(SUITE_HELP)


def test_bench_alone_names_every_suite(capsys):
    assert main(["bench"]) == 2
    err = capsys.readouterr().err
    suites = _suites()
    assert {"core", "grid", "maxlen", "masks", "train", "infer"} <= set(suites)
    assert err.count("\n") == 1 and all(name in err for name in suites), err


@pytest.mark.parametrize("argv,prefix", [(["bench", "--cluster", "nope"], "burstattn bench: error: "),
                                         (["bench", "train", "--cluster", "nope"], "burstattn bench train: error: "),
                                         (["bench", "infer", "--cluster", "inter=1x"], "burstattn bench infer: error: ")])
def test_bench_bad_cluster_is_one_line(capsys, monkeypatch, argv, prefix):
    import bench.cluster.spec as spec

    monkeypatch.setattr(spec, "rank_flops", lambda *a, **k: pytest.fail("measured before checking --cluster"))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(prefix) and err.count("\n") == 1 and "--cluster" in err and "a100-pcie-roce" in err, err


def test_ctrl_c_is_one_line(capsys, monkeypatch):
    def interrupted(ns):
        raise KeyboardInterrupt

    parser = build_parser()
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    parser._subparsers._group_actions[0].choices["plan"].set_defaults(handler=interrupted)
    assert main(["plan", "--seq-len", "1024"]) == 130
    assert capsys.readouterr().err == "burstattn plan: interrupted\n"


def test_bench_needs_a_checkout_in_one_line(capsys, monkeypatch, tmp_path):
    """Measurement is not installed: outside a source checkout ``burstattn bench`` says where it lives."""
    from burstattn.cli import forward

    assert forward.bench_package(tmp_path) is None  # no bench/ beside the package
    monkeypatch.setattr(forward, "bench_package", lambda: None)
    assert main(["bench", "core", "--suites", "overhead"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "python -m bench" in err and "source checkout" in err, err


def test_bench_runs_as_a_module_from_the_repository_root():
    import subprocess
    import sys
    from pathlib import Path

    import burstattn

    root = Path(burstattn.__file__).parents[1]
    res = subprocess.run([sys.executable, "-m", "bench", "train", "--help"], capture_output=True, text=True,
                         timeout=120, cwd=str(root))
    assert res.returncode == 0 and "--max-len" in res.stdout, res.stderr

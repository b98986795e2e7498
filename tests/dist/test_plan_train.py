"""`burstattn plan` prints a winner's `burstattn train` command that runs as printed: a tiny case on 4
local processes through the command line, and the winner of every preset at a small size (one real step
on local ranks where this CPU holds the model, hybrids included; the dry run, which runs the same job
on fake tensors, for the large presets and for more GPUs than this machine runs at once)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from burstattn.cli import build_parser, main
from burstattn.cli.verify import train_config
from tests.dist.cases.models import run_training

REPO = Path(__file__).resolve().parents[2]


def test_the_winners_printed_command_trains(capsys, tmp_path):
    assert main(["plan", "--model", "tiny", "--seq-len", "512", "--gpus", "4", "--batch", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    command = out[out.index("run the winner with:") + 1].split()
    assert command[:2] == ["burstattn", "train"] and "--world-size" in command, command
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    metrics = tmp_path / "m.jsonl"
    done = subprocess.run([sys.executable, "-m", "burstattn.cli", *command[1:], "--steps", "1", "--no-progress",
                           "--metrics", str(metrics)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, " ".join(command) + "\n" + done.stderr[-3000:]
    assert "burstattn train: 1 steps, final loss" in done.stdout
    rec = json.loads(metrics.read_text())
    ns = build_parser().parse_args(command[1:])
    assert (rec["world_size"], rec["dp"], rec["cp"], rec["tp"], rec["strategy"]) == (
        4, ns.dp, ns.cp, ns.tp, ns.strategy), (rec, command)


# (preset, GPUs, tokens): the winner is run for real on local ranks ("run") or dry-run ("dry")
WINNERS = [("tiny", 3, 384, "run"), ("small", 2, 256, "run"), ("small-l3", 3, 384, "run"),
           ("hybrid-tiny", 2, 256, "run"), ("hybrid-tiny", 3, 384, "run"), ("hybrid-small", 2, 256, "run"),
           ("hybrid-small", 8, 256, "dry"),  # it was a tensor-parallel plan the hybrid model refuses
           ("llama-7b", 2, 256, "dry"), ("llama3-8b", 2, 256, "dry"), ("llama-13b", 2, 256, "dry"),
           ("llama-70b", 16, 256, "dry"), ("llama3-405b", 64, 256, "dry")]
HEAVY = {"llama3-8b", "llama-13b", "llama-70b", "llama3-405b"}  # 20 s to minutes each: -m slow


def printed_winner(capsys, model: str, gpus: int, seq_len: int) -> str:
    """The ``burstattn train`` command ``burstattn plan`` prints for its winner."""
    assert main(["plan", "--model", model, "--gpus", str(gpus), "--seq-len", str(seq_len)]) == 0
    out = capsys.readouterr().out.splitlines()
    return out[out.index("run the winner with:") + 1].strip()


@pytest.mark.slow
@pytest.mark.parametrize("model,gpus,seq_len,how", WINNERS, ids=[f"{m}-{g}gpus-{how}" for m, g, _, how in WINNERS])
def test_every_presets_winner_runs(pools, capsys, model, gpus, seq_len, how, slow_selected):
    if model in HEAVY and not slow_selected:
        pytest.skip("a dry run of a large model takes 20 s to minutes: -m slow")
    cfg, world = train_config(printed_winner(capsys, model, gpus, seq_len))
    assert world == gpus and cfg.model == model
    if model.startswith("hybrid"):
        assert cfg.tp in (None, 1) and not cfg.strategy.startswith("tp"), cfg
    if how == "run":
        out = pools.get(world).run(run_training, cfg.with_overrides(steps=1), False)
        assert all(len(r["losses"]) == 1 and 0 < r["losses"][0] < 10 for r in out), out
    else:
        from burstattn.train.dryrun import dry_run

        report = dry_run(cfg, world, 0)
        assert report["peak_bytes"] > 0 and report["attention_calls"] > 0, report

"""`burstattn plan` prints a winner's `burstattn train` command that runs as printed: here a tiny
case on 4 local processes, for one step."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from burstattn.cli import build_parser, main

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

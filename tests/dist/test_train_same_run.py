"""Ranks launched with different training settings raise on every rank at job start, naming the setting
and its values in rank order (no silently different training, no collective of mismatched sizes); a
file is compared by its content, not its path; equal settings written differently (a default left out)
still run."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from tests.dist.cases import agreement as ac
from tests.dist.proc_tools import REPO


@pytest.mark.parametrize("world", [2, 3])
def test_differing_settings_raise_on_every_rank(pools, world):
    pool = pools.get(world)
    for field, values, shown in [("seed", [1, 2, 1], "[1, 2{}]"), ("lr", [1e-3, 2e-3, 2e-3], "[0.001, 0.002{}]"),
                                 ("vocab_size", [256, 512, 512], "[256, 512{}]")]:
        tail = {"seed": ", 1", "lr": ", 0.002", "vocab_size": ", 512"}[field] if world == 3 else ""
        results = pool.run(ac.train_flags, field, values)
        want = f"{field} must be the same on every rank of the group, got {shown.format(tail)} (rank order)"
        for rank, (kind, message) in enumerate(results):
            assert kind == "Disagreement" and message.startswith(want), (field, rank, kind, message)
            assert message.count("must be the same") == 1, message  # that setting alone


def test_defaults_and_values_they_resolve_to_agree_and_bad_flags_raise_everywhere(pools, tmp_path):
    pool = pools.get(2)
    assert pool.run(ac.train_flags, "vocab_size", [None, 256]) == [("no error", "")] * 2  # tiny's vocabulary
    assert pool.run(ac.train_flags, "layout", [None, "zigzag"]) == [("no error", "")] * 2  # burst's default
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("the same text, twice over " * 10)
    b.write_bytes(a.read_bytes())
    assert pool.run(ac.train_flags, "data", [str(a), str(b)]) == [("no error", "")] * 2  # paths differ, content not
    b.write_text("other text of another size " * 10)
    for kind, message in pool.run(ac.train_flags, "data", [str(a), str(b)]):
        assert kind == "Disagreement" and message.startswith("data must be the same"), message
        assert "content 260 bytes" in message and "content 270 bytes" in message, message
    missing = str(tmp_path / "missing.txt")  # a file one host lacks: that rank's own problem, raised everywhere
    for kind, message in pool.run(ac.train_flags, "data", [str(a), missing]):
        assert kind == "ValueError" and message == f"--data: no such file {missing!r} (--data expects one token " \
            "file: uint16 / uint32 ids (nanoGPT's .bin) or UTF-8 text) (rank 1 of 2; every rank aborts)", message


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ranks_started_with_different_flags_under_torchrun_exit_with_one_line(tmp_path):
    """Two workers in torchrun's environment, launched with --seed 1 and --seed 2 (and --vocab-size 256 and
    512): both exit with status 2, rank 0 prints one line naming the flag and the values in rank order."""
    port = _free_port()
    base = ["train", "--model", "tiny", "--steps", "1", "--seq-len", "120", "--batch", "2", "--no-progress"]
    for extra, needle in [(("--seed", "1", "--seed", "2"), "seed must be the same on every rank of the group, got "
                                                           "[1, 2] (rank order)"),
                          (("--vocab-size", "256", "--vocab-size", "512"), "vocab_size must be the same on every "
                                                                           "rank of the group, got [256, 512]")]:
        procs = []
        for rank in range(2):
            env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", RANK=str(rank), LOCAL_RANK=str(rank),
                       WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            args = base + [extra[2 * rank], extra[2 * rank + 1]]
            procs.append(subprocess.Popen([sys.executable, "-m", "burstattn.cli", *args], env=env, text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        outs = [p.communicate(timeout=180) for p in procs]
        assert [p.returncode for p in procs] == [2, 2], outs
        lines = [line for line in outs[0][1].splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("burstattn train: error: " + needle), outs[0][1]
        assert outs[1][1].strip() == "", outs[1][1]  # the same error: rank 0 says it
        port = _free_port()

"""Checkpointing modes (attention calls, gradients, memory), exact resume, a rank killed during a
save, resharding a checkpoint to another world size, a rank dying mid-step, and `burstattn train`."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from burstattn.testing.launch import LocalGroupError, run_local
from burstattn.train import TrainConfig
from burstattn.train.checkpoint import latest_checkpoint, step_dirs
from tests.dist.cases import models as tc

BASE = TrainConfig(model="tiny", seq_len=120, batch=2, steps=6, lr=1e-3, warmup=1, seed=5)
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("case", [dict(strategy="burst"), dict(strategy="tp-v3", fsdp=True),
                                  dict(strategy="ulysses", mlp_chunk=64, loss_chunk=96)])
def test_checkpointing_modes(pools, case):
    """Distributed attention forwards per step: L (none, remat), 2L (full), counted as executions of
    the attention ops (remat's recomputation answers them from its record) and as forward bytes (burst,
    ulysses); equal gradients; the bytes the forward keeps and the peak per mode."""
    cfg = BASE.with_overrides(seq_len=512, batch=1, **case)
    out = pools.get(2).run(tc.checkpointing_modes, cfg)
    for rank_out in out:
        layers = rank_out["none"]["layers"]
        assert {m: r["calls"] for m, r in rank_out.items()} == {"none": layers, "full": 2 * layers,
                                                                "remat": layers}
        if case["strategy"] != "tp-v3":  # tp-v3 here: attention over a cp group of one, no bytes
            one = rank_out["none"]["forward_bytes"]
            assert one > 0 and {m: r["forward_bytes"] for m, r in rank_out.items()} == \
                {"none": one, "full": 2 * one, "remat": one}
    modes = out[0]
    for mode in ("full", "remat"):
        for name, g in modes["none"]["grads"].items():
            err = float((modes[mode]["grads"][name] - g).norm() / g.norm())
            assert err < 1e-6, (mode, name, err)
    peaks = {m: max(r[m]["peak"] for r in out) for m in modes}
    if case["strategy"] != "ulysses":
        assert max(peaks["full"], peaks["remat"]) < peaks["none"], peaks
    # ulysses (tiny: 2 layers, 512 tokens): full peaks above none (seen 1.92-2.11 MB against 1.64-1.78 MB).
    # Its op keeps only its head-sharded q, k, v, output and LSE (no copies of its inputs), so none holds two
    # layers of those, while full's backward holds one recomputed layer's plus the recomputation's
    # all-to-all buffers and the gradients: with two layers, one recomputation outweighs the second kept layer
    # (our reading of the numbers, not traced tensor by tensor).
    # What the modes differ in is what the forward keeps: full keeps each layer's input, remat also the
    # attention op's outputs (out, lse) per layer (so it never reruns the distributed attention), none
    # everything. (Which of full and remat peaks lower depends on the length: tests/dist/test_blockwise_training.py
    # measures the kept bytes against the floor.)
    kept = {m: max(r[m]["kept"] for r in out) for m in modes}
    assert max(kept["full"], kept["remat"]) < kept["none"] or case["strategy"] == "ulysses", kept
    if case["strategy"] == "burst":
        assert kept["full"] < kept["remat"], kept
    # Not asserted, as measured (findings, not explained yet): tp-v3 with FSDP had full 1,184,800 B > remat
    # 1,061,920 B kept at the end of the forward; ulysses' kept bytes in this sequence of calls differ from the
    # same configuration alone in a fresh process (full 0.33 MB < none 0.86 MB < remat 1.12 MB: remat keeps its
    # op's outputs, the head-sharded q, k, v and output). These end bytes include whatever else a forward
    # leaves allocated (FSDP's and the collectives' buffers).


def test_resume_is_bitwise_exact(pools, tmp_path):
    cfg = BASE.with_overrides(ckpt_dir=str(tmp_path), ckpt_every=3, keep=2)
    whole = pools.get(2).run(tc.loop_run, BASE)[0]["records"]
    assert pools.get(2).run(tc.loop_run, cfg, 4)[0]["records"] is None  # stopped before step 5
    assert [s for s, _ in step_dirs(tmp_path)] == [3]
    resumed = pools.get(2).run(tc.loop_run, cfg.with_overrides(resume=True))[0]["records"]
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in whole[3:]]  # bitwise
    assert [s for s, _ in step_dirs(tmp_path)] == [3, 6]


def test_sigkill_during_save_leaves_previous_checkpoint(pools, tmp_path):
    cfg = BASE.with_overrides(ckpt_dir=str(tmp_path), ckpt_every=2, keep=3, pg_timeout_s=5.0)
    with pytest.raises(LocalGroupError) as info:
        run_local(tc.loop_run, 2, cfg, 0, "save", 4, pg_timeout_s=5.0, timeout_s=120.0)
    assert "exited" in info.value.errors[1].message or "died" in info.value.errors[1].message, info.value.errors[1]
    assert 0 in info.value.errors
    assert (tmp_path / "step-4").is_dir() and not (tmp_path / "step-4" / ".metadata").exists()
    assert latest_checkpoint(tmp_path)[0] == 2
    whole = pools.get(2).run(tc.loop_run, BASE)[0]["records"]
    out = pools.get(2).run(tc.load_and_continue, cfg, 2)[0]
    assert out["start"] == 2
    assert out["losses"] == [r["loss"] for r in whole[2:4]]
    # the next save of step 4 replaces the stale directory
    resumed = pools.get(2).run(tc.loop_run, cfg.with_overrides(resume=True))[0]["records"]
    assert [r["step"] for r in resumed] == [3, 4, 5, 6]
    assert [s for s, _ in step_dirs(tmp_path)] == [2, 4, 6]


@pytest.mark.parametrize("save,load", [((4, dict(strategy="burst", dp=2, fsdp=True)), (2, dict(strategy="tp-v3"))),
                                       ((2, dict(strategy="ulysses", fsdp=True)), (1, dict(strategy="burst")))])
def test_checkpoint_reshards(pools, tmp_path, save, load):
    (w_save, c_save), (w_load, c_load) = save, load
    saved = pools.get(w_save).run(tc.save_at, BASE.with_overrides(steps=3, ckpt_dir=str(tmp_path), **c_save))[0]
    loaded = pools.get(w_load).run(tc.load_and_continue, BASE.with_overrides(steps=3, ckpt_dir=str(tmp_path),
                                                                              **c_load), 2)[0]
    assert loaded["start"] == 3
    for name, p in saved["params"].items():
        assert float((loaded["params"][name] - p).abs().max()) == 0.0, name
    for got, want in zip(loaded["losses"], saved["losses"]):  # the optimizer state came along too
        assert abs(got - want) <= 1e-5 * want


def test_dead_rank_mid_step_makes_the_others_exit(tmp_path):
    cfg = BASE.with_overrides(pg_timeout_s=5.0)
    with pytest.raises(LocalGroupError) as info:
        run_local(tc.loop_run, 3, cfg, 0, "step", 2, pg_timeout_s=5.0, timeout_s=120.0)
    errors = info.value.errors
    assert "exited" in errors[1].message or "died" in errors[1].message, errors[1]
    for rank in (0, 2):
        assert rank in errors, f"rank {rank} did not fail"
        assert "TrainingError" in errors[rank].type_names, errors[rank].traceback
        # the survivors' own error (naming the step), not the pool's timeout: they did not hang
        assert "step 3" in errors[rank].message and "peer died" in errors[rank].message


def test_burstattn_train_cli(tmp_path):
    metrics = tmp_path / "m.jsonl"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "burstattn.cli", "train", "--config", str(REPO / "configs/train/passkey-tiny.toml"),
           "--world-size", "2", "--steps", "3", "--seq-len", "120", "--batch", "2", "--metrics", str(metrics),
           "--ckpt-dir", str(tmp_path / "ck"), "--no-progress"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3]
    for r in lines:
        assert {"step", "loss", "tokens_per_s", "peak_mem_bytes", "lr"} <= set(r) and r["cp"] == 2
    assert (tmp_path / "ck" / "step-3" / ".metadata").is_file()
    bad = subprocess.run(cmd[:4] + ["--world-size", "2", "--strategy", "ring", "--layout", "diagonal", "--no-progress"],
                         env=env, capture_output=True, text=True, timeout=180)
    assert bad.returncode == 2 and "layout" in bad.stderr


def test_burstattn_train_under_torchrun(tmp_path):
    """The same `burstattn train` command under `torchrun` joins torchrun's group (its environment is
    detected, no --world-size) and trains exactly as the local launcher does."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    args = ["-m", "burstattn.cli", "train", "--model", "tiny", "--steps", "3", "--seq-len", "120", "--batch", "2",
            "--strategy", "burst", "--no-progress"]
    local, under = tmp_path / "local.jsonl", tmp_path / "torchrun.jsonl"
    done = subprocess.run([sys.executable] + args + ["--world-size", "2", "--metrics", str(local)], env=env,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
                          + args + ["--metrics", str(under), "--ckpt-dir", str(tmp_path / "ck")], env=env,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    want = [json.loads(x) for x in local.read_text().splitlines()]
    got = [json.loads(x) for x in under.read_text().splitlines()]
    assert [r["step"] for r in got] == [1, 2, 3] and all(r["world_size"] == 2 and r["cp"] == 2 for r in got)
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-6)
    assert (tmp_path / "ck" / "step-3" / ".metadata").is_file()

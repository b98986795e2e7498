"""Resuming that says what it did (multi-process, through the training loop): damaged checkpoints
skipped with one line each or refused naming the directory, the checkpoint resumed from, a missing
or empty --ckpt-dir, another model, another seed / lr (refused, or applied with --allow-changes),
and a --metrics file without a step twice."""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from burstattn.testing.launch import LocalGroupError
from burstattn.train import TrainConfig
from burstattn.train.checkpoint import step_dirs
from burstattn.train.job import lr_lambda
from tests.dist.cases import models as tc

BASE = TrainConfig(model="tiny", seq_len=120, batch=2, steps=6, lr=1e-3, warmup=1, seed=5)
WORLD = 2
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def whole(pools):
    """The losses of the uninterrupted run."""
    return [r["loss"] for r in pools.get(WORLD).run(tc.loop_run, BASE)[0]["records"]]


@pytest.fixture
def saved(pools, tmp_path):
    """``tmp_path/ck`` with step-2 and step-4 of BASE (the run stopped before step 5)."""
    cfg = BASE.with_overrides(ckpt_dir=str(tmp_path / "ck"), ckpt_every=2, keep=3)
    assert pools.get(WORLD).run(tc.loop_run, cfg, 4)[0]["records"] is None
    assert [s for s, _ in step_dirs(cfg.ckpt_dir)] == [2, 4]
    return cfg


def _truncate(path, keep=0.5):
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])


def _refusals(info) -> list[str]:
    """Every rank's message (each must have raised)."""
    errors = info.value.errors
    assert set(errors) == set(range(WORLD)), errors
    return [errors[r].message for r in range(WORLD)]


@pytest.mark.parametrize("damage", ["distcp", "metadata", "no-metadata"])
def test_damaged_newest_checkpoint_falls_back_with_one_line(pools, whole, saved, damage):
    step4 = saved.ckpt_dir + "/step-4"
    target = {"distcp": sorted(Path(step4).glob("*.distcp"))[-1], "metadata": Path(step4) / ".metadata",
              "no-metadata": None}[damage]
    if target is None:
        (Path(step4) / ".metadata").unlink()
    else:
        _truncate(target)
    out = pools.get(WORLD).run(tc.loop_run, saved.with_overrides(resume=True))[0]
    assert [r["step"] for r in out["records"]] == [3, 4, 5, 6]
    assert [r["loss"] for r in out["records"]] == whole[2:]  # bitwise: resumed exactly from step 2
    skipped = [line for line in out["log"] if line.startswith("skipped")]
    assert len(skipped) == 1 and step4 in skipped[0] and "\n" not in skipped[0], out["log"]
    why = {"distcp": f"{target.name if target else ''} is truncated", "metadata": ".metadata is unreadable",
           "no-metadata": "no .metadata"}[damage]
    assert why in skipped[0], skipped
    assert f"resumed from {saved.ckpt_dir}/step-2 (step 2)" in out["log"], out["log"]


def test_no_checkpoint_that_loads_is_refused_naming_the_directory(pools, saved):
    for step in (2, 4):
        _truncate(sorted((Path(saved.ckpt_dir) / f"step-{step}").glob("*.distcp"))[0])
    with pytest.raises(LocalGroupError) as info:
        pools.get(WORLD).run(tc.loop_run, saved.with_overrides(resume=True))
    for message in _refusals(info):
        assert message.startswith("ResumeError: --resume: no checkpoint in ") and saved.ckpt_dir in message
        assert "step-4: " in message and "step-2: " in message and "\n" not in message


def test_missing_ckpt_dir_is_refused_and_an_empty_one_is_said(pools, tmp_path):
    with pytest.raises(LocalGroupError) as info:
        pools.get(WORLD).run(tc.loop_run, BASE.with_overrides(resume=True, ckpt_dir=str(tmp_path / "typo"), steps=1))
    for message in _refusals(info):
        assert "--ckpt-dir" in message and "typo" in message and "does not exist" in message
    assert not (tmp_path / "typo").exists()
    (tmp_path / "empty").mkdir()
    out = pools.get(WORLD).run(tc.loop_run, BASE.with_overrides(resume=True, ckpt_dir=str(tmp_path / "empty"),
                                                                  steps=1))[0]
    assert [r["step"] for r in out["records"]] == [1]
    assert out["log"] == [f"--resume: no checkpoint in {tmp_path / 'empty'} yet: starting at step 1"]


def test_another_model_is_one_line_naming_the_fields(pools, saved):
    with pytest.raises(LocalGroupError) as info:
        pools.get(WORLD).run(tc.loop_run, saved.with_overrides(resume=True, vocab_size=320))
    for message in _refusals(info):
        assert "holds another model (vocab_size 256 there, 320 here)" in message and "\n" not in message


def test_changed_seed_or_lr_is_refused_unless_allowed(pools, saved):
    with pytest.raises(LocalGroupError) as info:
        pools.get(WORLD).run(tc.loop_run, saved.with_overrides(resume=True, seed=6, lr=2e-3))
    for message in _refusals(info):
        assert "--seed 5 -> 6" in message and "--lr 0.001 -> 0.002" in message and "--allow-changes" in message
    changed = saved.with_overrides(resume=True, lr=2e-3, steps=8, allow_changes=True)
    out = pools.get(WORLD).run(tc.loop_run, changed)[0]
    assert [r["step"] for r in out["records"]] == [5, 6, 7, 8]
    want = [2e-3 * lr_lambda(changed)(s) for s in range(4, 8)]  # the new rate and schedule apply
    assert [r["lr"] for r in out["records"]] == pytest.approx(want, rel=1e-12)
    assert any(line.startswith("--allow-changes: --lr 0.001 -> 0.002") for line in out["log"]), out["log"]
    assert "changed: --steps 6 -> 8" in out["log"], out["log"]


def test_metrics_keep_no_step_twice_after_resume(pools, whole, tmp_path):
    metrics = tmp_path / "m.jsonl"
    cfg = BASE.with_overrides(ckpt_dir=str(tmp_path / "ck"), ckpt_every=3, metrics=str(metrics))
    assert pools.get(WORLD).run(tc.loop_run, cfg, 5)[0]["records"] is None  # steps 1-5 logged, step-3 saved
    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()] == [1, 2, 3, 4, 5]
    with open(metrics, "a") as f:
        f.write('{"step": 6, "lo')  # a line cut short by a kill
    out = pools.get(WORLD).run(tc.loop_run, cfg.with_overrides(resume=True))[0]
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in lines] == whole
    assert any("dropped 3 line(s) past step 3" in line for line in out["log"]), out["log"]


def test_token_file_with_a_larger_vocabulary(pools, tmp_path):
    """--data with ids up to 4999 (a real tokenizer's) trains once --vocab-size covers them."""
    import numpy as np

    path = tmp_path / "tokens.bin"
    ids = np.random.default_rng(0).integers(0, 5000, 4096, dtype=np.uint16)
    ids[100] = 4999
    ids.tofile(path)
    cfg = BASE.with_overrides(data=str(path), steps=2, vocab_size=5000)
    out = pools.get(WORLD).run(tc.run_training, cfg, False)
    assert out[0]["losses"] == out[1]["losses"]
    assert abs(out[0]["losses"][0] - math.log(5000)) < 0.5, out[0]["losses"]  # near uniform at the start
    with pytest.raises(LocalGroupError) as info:
        pools.get(WORLD).run(tc.run_training, cfg.with_overrides(vocab_size=None), False)
    for message in _refusals(info):
        assert "token id 4999" in message and "--vocab-size 5000" in message


def test_burstattn_train_says_once_what_the_resume_did(saved):
    """The command line: rank 0 alone prints each line (world 2), the newest checkpoint is damaged."""
    _truncate(sorted(Path(saved.ckpt_dir, "step-4").glob("*.distcp"))[0])
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "burstattn.cli", "train", "--model", "tiny", "--seq-len", "120", "--batch", "2",
           "--steps", "3", "--lr", "0.001", "--warmup", "1", "--seed", "5", "--world-size", "2", "--resume",
           "--ckpt-dir", saved.ckpt_dir, "--no-progress"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stderr.splitlines() if line.startswith("burstattn train: ")]
    have = Path(saved.ckpt_dir, "step-4", "__0_0.distcp").stat().st_size
    assert re.fullmatch(rf"burstattn train: skipped {saved.ckpt_dir}/step-4: __0_0\.distcp is truncated "
                        rf"\({have:,} of [0-9,]+ bytes\)", said[0]), said
    assert said[1:] == [f"burstattn train: resumed from {saved.ckpt_dir}/step-2 (step 2)",
                    "burstattn train: changed: --steps 6 -> 3"], done.stderr
    assert "Traceback" not in done.stderr
    assert done.stdout.strip().splitlines()[-1].startswith("burstattn train: 3 steps, final loss")

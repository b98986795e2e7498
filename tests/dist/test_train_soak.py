"""Soak: 1,000 steps of the tiny model at world 2; resident memory at step 1,000 within 5% of
step 100 on every rank (no leak in the step, the loop, the metrics or the collectives)."""
from __future__ import annotations

import pytest

from burstattn.testing.launch import run_local
from burstattn.train import TrainConfig
from tests.dist.train_cases import soak


@pytest.mark.slow
def test_soak_resident_memory_is_flat(tmp_path):
    cfg = TrainConfig(model="tiny", seq_len=128, batch=2, steps=1000, lr=1e-3, warmup=10,
                      metrics=str(tmp_path / "soak.jsonl"))
    records = run_local(soak, 2, cfg, timeout_s=1800.0)[0]
    at100, at1000 = records[99]["rss_bytes_per_rank"], records[999]["rss_bytes_per_rank"]
    print("RSS per rank at step 100:", at100, "at step 1000:", at1000)
    for before, after in zip(at100, at1000):
        assert abs(after - before) <= 0.05 * before, (at100, at1000)

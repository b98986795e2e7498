"""Soak: the tiny model at world 2 for 1,000 steps; resident memory at the last step within 5% of step 100 on
every rank (no leak in the step, the loop, the metrics or the collectives). It runs with ``-m slow`` only: at
about 0.1 s a step on 2 cores it would take a tenth of the suite's 30 minutes."""
from __future__ import annotations

import pytest

from burstattn.testing.launch import run_local
from burstattn.train import TrainConfig
from tests.dist.cases.models import soak


@pytest.fixture
def steps(slow_selected) -> int:
    if not slow_selected:
        pytest.skip("1,000 training steps: run with -m slow")
    return 1000


@pytest.mark.slow
def test_soak_resident_memory_is_flat(tmp_path, steps):
    cfg = TrainConfig(model="tiny", seq_len=128, batch=2, steps=steps, lr=1e-3, warmup=10,
                      metrics=str(tmp_path / "soak.jsonl"))
    records = run_local(soak, 2, cfg, timeout_s=1800.0)[0]
    assert len(records) == steps
    at100, last = records[99]["rss_bytes_per_rank"], records[-1]["rss_bytes_per_rank"]
    for before, after in zip(at100, last):
        assert abs(after - before) <= 0.05 * before, (at100, last)

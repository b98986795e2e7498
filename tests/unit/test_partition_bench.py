"""The pure parts of ``burstattn bench partition``: the long-tailed documents and the plan figures."""
from __future__ import annotations

import pytest

from bench.partition_balance import (LAYOUTS, MASKS, PartitionBenchConfig, build_mask, layout_of, long_tailed,
                                     markdown, plan_figures)


def test_long_tailed_documents_cover_the_sequence():
    cu = long_tailed(4096)
    assert cu[0] == 0 and cu[-1] == 4096 and all(b > a for a, b in zip(cu, cu[1:]))
    assert max(b - a for a, b in zip(cu, cu[1:])) <= 2048


@pytest.mark.parametrize("name", MASKS)
def test_plan_figures_and_table(name):
    cfg = PartitionBenchConfig(seq_len=1024, world_size=4, block_size=32)
    mask = build_mask(name, cfg.seq_len, cfg.block_size)
    rows = []
    for lay in LAYOUTS:
        fig = plan_figures(mask, layout_of(lay, mask, cfg.seq_len, cfg.world_size), cfg)
        assert fig["work"] >= 1.0 and fig["bytes"] > 0
        rows.append(dict(mask=name, layout=lay, **fig, slowest_cpu_s=1.0, mean_cpu_s=0.5))
    best_fixed = min(r["max_work"] for r in rows[:3])
    assert rows[3]["max_work"] <= best_fixed * 1.05  # the solver's slowest rank is never much worse
    assert markdown(rows, cfg).count("\n| ") == len(rows) + 1

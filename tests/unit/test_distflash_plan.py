"""The DistFlashAttn plan (pure): every causal block pair computed exactly once, transfers
symmetric between the two ends, and equal work per rank on every step but the last."""
from __future__ import annotations

import pytest

from burstattn.engine.schedule import distflash_plan


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8, 9])
def test_plan_covers_each_causal_pair_once(world):
    pairs = []
    for r in range(world):
        for st in distflash_plan(r, world):
            if st.own_k is not None:
                pairs.append((r, st.own_k))
            if st.helper_q is not None:
                pairs.append((st.helper_q, r))
    assert sorted(pairs) == sorted((i, j) for i in range(world) for j in range(i + 1))


@pytest.mark.parametrize("world", [2, 3, 4, 6, 8])
def test_plan_transfers_are_symmetric(world):
    plans = [distflash_plan(r, world) for r in range(world)]
    for r in range(world):
        for st in plans[r]:
            if st.kv_to is not None:
                assert plans[st.kv_to][st.step].own_k == r
            if st.q_to is not None:
                assert plans[st.q_to][st.step].helper_q == r
            if st.own_k not in (None, r):
                assert plans[st.own_k][st.step].kv_to == r
            if st.helper_q is not None:
                assert plans[st.helper_q][st.step].q_to == r


@pytest.mark.parametrize("world", [3, 4, 5, 8])
def test_every_rank_works_on_every_step_but_the_last(world):
    steps = len(distflash_plan(0, world))
    assert steps == world // 2 + 1
    for t in range(steps - (1 if world % 2 == 0 else 0)):
        busy = [st.own_k is not None or st.helper_q is not None
                for st in (distflash_plan(r, world)[t] for r in range(world))]
        assert all(busy), (world, t)

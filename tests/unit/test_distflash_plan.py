"""The DistFlashAttn plan (pure): every causal block pair computed exactly once, transfers
symmetric between the two ends, and equal work per rank on every step but the last."""
from __future__ import annotations

import pytest

from burstattn.engine.direct import direct, distflash_steps
from burstattn.engine.pairs import ops_from_positions
from burstattn.engine.plan import plan_cost
from burstattn.layouts.named import local_positions


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8, 9])
def test_plan_covers_each_causal_pair_once(world):
    """Every causal (query rank, key rank) pair is computed exactly once, row halves counted as 1/2."""
    covered = {}
    for r in range(world):
        for st in distflash_steps(r, world):
            if st.own_k is not None:
                covered.setdefault((r, st.own_k), []).append(st.own_part or (0, 1))
            if st.helper_q is not None:
                covered.setdefault((st.helper_q, r), []).append(st.helper_part or (0, 1))
    assert sorted(covered) == sorted((i, j) for i in range(world) for j in range(i + 1))
    for parts in covered.values():
        assert sorted(parts) in ([(0, 1)], [(0, 2), (1, 2)])


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 6, 8, 9])
def test_every_rank_does_the_same_work(world):
    """P/2 blocks of n x n score entries per rank (the causal diagonal counts 1/2, a half step 1/2),
    counted on the plan that runs: perfect balance."""
    n = 4
    pos = [local_positions(n * world, r, world, "contiguous") for r in range(world)]
    ops_of = ops_from_positions(pos, pos, True)
    for r in range(world):
        assert plan_cost(direct(r, distflash_steps(r, world), world, ops_of, n)) == world / 2 * n * n


@pytest.mark.parametrize("world", [2, 3, 4, 6, 8])
def test_plan_transfers_are_symmetric(world):
    plans = [distflash_steps(r, world) for r in range(world)]
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


@pytest.mark.parametrize("world", [2, 3, 4, 5, 8])
def test_every_rank_works_on_every_step(world):
    steps = len(distflash_steps(0, world))
    assert steps == world // 2 + 1
    for t in range(steps):
        busy = [st.own_k is not None or st.helper_q is not None
                for st in (distflash_steps(r, world)[t] for r in range(world))]
        assert all(busy), (world, t)

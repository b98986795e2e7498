"""The traps that need several ranks: every one raises clearly on every rank (or is
fixed), never a silent wrong answer, never a hang."""
from __future__ import annotations

import pytest

from tests.dist.cases import agreement


def test_mask_mods_must_agree(pools):
    results = pools.get(2).run(agreement.mask_disagreement)
    assert len({tuple(r) for r in results}) == 1, results  # the same messages on every rank
    for same_plan, other_plan in results:  # a Disagreement is a ValueError naming the differing field
        assert same_plan.startswith("Disagreement") and "mask" in same_plan and "same on every rank" in same_plan
        assert other_plan.startswith(("ValueError", "Disagreement")) and "mask" in other_plan


def test_cached_mask_mod_raising_mid_ring_raises_everywhere(pools):
    results = pools.get(2).run(agreement.mask_raises_mid_ring)
    assert len({second for _, second, _ in results}) == 1, results  # the same message on every rank
    for first, second, third in results:
        assert first == "no error" and third == "no error", (first, third)
        assert second.startswith("ValueError") and "mask_mod raised RuntimeError: flaky" in second, second
        assert "(rank 1 of 2; every rank aborts)" in second, second


def test_usp_degrees_build_groups_once(pools):
    for r in pools.get(4).run(agreement.usp_group_reuse):
        assert r["same_groups"] and r["entries"] == 1, r
        assert r["fd_growth"] <= 1, r  # no growth beyond one unrelated descriptor


def test_rank_outside_group_is_told(pools):
    results = pools.get(3).run(agreement.outside_group)
    assert results[:2] == [["member"], ["member"]]
    for text in results[2]:
        assert text.startswith("ValueError") and "not a member of group" in text, text


def test_different_strategies_named(pools):
    for text in pools.get(2).run(agreement.different_strategies):
        assert "function (burst_attn_func or the attention strategy) must be the same" in text, text
        assert "'burst'" in text and "'ring'" in text, text


def test_module_topology_and_return_lse(pools):
    for r in pools.get(4).run(agreement.module_topology_and_lse):
        assert r["out"] < 1e-5 and r["lse"] < 1e-5, r


def test_nan_reaches_every_rank(pools):
    for r in pools.get(2).run(agreement.nan_across_ranks):
        assert r == dict(all_nan_head0=True, head1_finite=True), r


@pytest.mark.parametrize("world", [2, 4])
def test_layout_none_is_zigzag_for_every_function_and_strategy(pools, world):
    from burstattn.strategies import STRATEGIES

    for r in pools.get(world).run(agreement.layout_none_is_zigzag):
        assert r["not_identity"] and r["shard"] and r["positions"] and r["gather"], r
        for name in STRATEGIES:
            assert r[name]["same"], (name, r[name])
            assert r[name]["error"] <= 1e-5, (name, r[name])  # and the answer is the float64 one

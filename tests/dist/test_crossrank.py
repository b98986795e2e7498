"""Values and gradient requests that differ between ranks are refused on EVERY rank:
ALiBi slopes or sink logits whose values differ would give each rank another attention (a
silent wrong answer), and a ``requires_grad`` set on one rank only would leave that rank blocked in the
backward until the process group's timeout."""
from __future__ import annotations

import pytest

from tests.dist.cases import agreement as cc

NEEDLES = {"alibi": "alibi_slopes (shape and values)", "sinks": "sinks (shape and values)",
           "requires_grad": "requires_grad"}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind", ["alibi", "sinks", "requires_grad"])
def test_differing_values_raise_on_every_rank(pools, world, kind):
    results = pools.get(world).run(cc.differing, kind)
    assert len(set(results)) == 1, results  # the same type and message on every rank
    kind_name, message = results[0]
    assert kind_name == "Disagreement", (kind_name, message)  # a ValueError
    assert NEEDLES[kind] in message and "must be the same on every rank" in message, message


@pytest.mark.parametrize("strategy", ["ring", "allgather", "ulysses"])
def test_requires_grad_on_one_rank_raises_on_every_rank_for_each_strategy(pools, strategy):
    results = pools.get(2).run(cc.differing, "requires_grad", strategy)
    assert len(set(results)) == 1 and results[0][0] == "Disagreement" and "requires_grad" in results[0][1], results


@pytest.mark.parametrize("kind", ["same"])
def test_equal_values_still_run(pools, kind):
    assert pools.get(2).run(cc.differing, kind) == [("no error", "")] * 2

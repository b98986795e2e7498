"""burstattn.comm.agree at worlds 2 and 3: one 16-byte digest per rank when the ranks agree; otherwise
every rank raises the same exception type and message, naming the differing field(s) and the values in
rank order, or the problem and the rank(s) that found it."""
from __future__ import annotations

import pytest

from tests.dist.cases import agreement as ac


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_raises_the_same(pools, world):
    pool = pools.get(world)
    assert pool.run(ac.exchange, "same") == [("no error", str((world - 1) * 16))] * world
    seeds = ", ".join(["1"] * (world - 1) + ["2"])
    want = {
        "value": ("Disagreement", f"check: seed must be the same on every rank of the group, got [{seeds}] (rank order)"),
        "alone": ("Disagreement", "check: function must be the same on every rank of the group, got ['g', "
                                  + ", ".join(["'f'"] * (world - 1)) + "] (rank order)"),
        "problem": ("ValueError", f"check: q must be 4-D (rank 1 of {world}; every rank aborts)"),
        "every": ("ValueError", "check: bad everywhere"),
    }
    for kind, expected in want.items():
        assert pool.run(ac.exchange, kind) == [expected] * world, kind
    if world == 3:  # two ranks with problems of their own: the lowest one's type, both named
        assert pool.run(ac.exchange, "problems") == [("TypeError", "check: invalid arguments on 2 of 3 ranks, every "
                                                      "rank aborts (rank 1: bad dtype 1; rank 2: bad shape)")] * 3

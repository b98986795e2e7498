"""One meaning per layout: for every strategy x every layout it accepts (the names, ``None`` =
zigzag, an arbitrary partition) x causal or not, shard_sequence -> attention -> gather_sequence
equals float64 attention, output and gradients, at worlds 2, 3 and 4."""
from __future__ import annotations

import itertools

import pytest

from burstattn.strategies import STRATEGIES
from tests.dist.cases import attention
from tests.helpers import EXACT, Case

HEADS = {2: "4/2", 3: "6/2", 4: "4/2"}


def rows(world: int) -> list:
    out = []
    for i, (strategy, layout, causal) in enumerate(itertools.product(
            sorted(STRATEGIES), ("none", "contiguous", "zigzag", "striped", "partition"), (False, True))):
        if layout == "partition" and not STRATEGIES[strategy].partitions:
            continue
        backend = "reference" if strategy == "rsa" or i % 2 else "cpu_flash"
        out.append((Case(world=world, local_seq=8, heads=HEADS[world], head_dim=16, causal=causal,
                         backend=backend, seed=i), strategy, layout))
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_strategy_every_layout(pools, world):
    grid = rows(world)
    results = pools.get(world).run(attention.layout_grid, grid)
    failures = []
    for (case, strategy, layout), res in zip(grid, results[0]):
        if isinstance(res, str) or max(res.values()) > EXACT["float32"]:
            failures.append(f"{strategy} layout={layout} causal={case.causal}: {res}")
    assert not failures, "\n".join(failures)
    assert all(r == results[0] for r in results), "the ranks disagree"  # all gathered the same tensors

"""mask_partition as the layout of every strategy that takes a partition and a mask (burst with both
backwards, ring, allgather, ulysses), for windows, documents, block-sparse and mask_mod masks, at
worlds 2, 3 and 4: exact against the float64 dense oracle (one pool call per world)."""
from __future__ import annotations

import pytest

from tests.dist.cases import masks as mpc
from tests.helpers import EXACT, Case


def _rows(world: int) -> list:
    rows = []
    for i, kind in enumerate(mpc.PARTITION_KINDS):
        for j, strategy in enumerate(mpc.PARTITION_STRATEGIES):
            causal = kind in ("window_causal", "docs") or (i + j) % 2 == 0
            backward = ("burst", "kv")[(i + j + world) % 2]
            heads = f"{2 * world}/{world}" if strategy == "ulysses" else ("gqa" if (i + j) % 2 else "mha")
            rows.append((Case(world=world, local_seq=16, heads=heads, head_dim=16, causal=causal,
                              backend=("cpu_flash", "reference")[(i + j) % 2], backward=backward, seed=i + j),
                         kind, strategy, 4))
    return rows


@pytest.mark.parametrize("world", [2, 3, 4])
def test_mask_partition_exact_on_every_strategy(pools, world):
    rows = _rows(world)
    results = pools.get(world).run(mpc.partitioned_grid, rows)
    for i, (case, kind, strategy, _) in enumerate(rows):
        per_rank = [r[i] for r in results]
        assert all(isinstance(r, dict) for r in per_rank), (kind, strategy, per_rank)
        assert len({r["fingerprint"] for r in per_rank}) == 1, "every rank builds the same partition"
        for rank, r in enumerate(per_rank):
            for name, err in r["errs"].items():
                assert err <= EXACT["float32"], (kind, strategy, rank, name, err, r["name"])

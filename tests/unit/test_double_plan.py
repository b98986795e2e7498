"""The double ring's plan (pure): every rank meets every block exactly once, each inner step moves a
block one hop inside the node, each outer step one hop across nodes."""
from __future__ import annotations

import pytest
import torch

from burstattn.engine.double import double_plan
from burstattn.engine.schedule import ring_plan
from burstattn.formulas import double_bytes, ring_bytes


@pytest.mark.parametrize("world,per_node", [(1, 1), (2, 1), (2, 2), (4, 2), (6, 3), (6, 2), (8, 4), (8, 2), (9, 3)])
@pytest.mark.parametrize("travelling", ["kv", "q"])
def test_every_block_once_and_hops_stay_local(world, per_node, travelling):
    for rank in range(world):
        plan = double_plan(rank, world, per_node, "zigzag", True, 8, travelling)
        srcs = [st.k_rank if travelling == "kv" else st.q_rank for inner in plan.outer for st in inner]
        assert sorted(srcs) == list(range(world))
        m, i = divmod(rank, per_node)
        for d, inner in enumerate(plan.outer):
            for s, st in enumerate(inner):
                src = st.k_rank if travelling == "kv" else st.q_rank
                assert src == ((m - d) % (world // per_node)) * per_node + (i - s) % per_node
                # the ops of a pair are the flat ring's ops of the same pair
                flat = {p.k_rank if travelling == "kv" else p.q_rank: p.ops
                        for p in ring_plan(rank, world, "zigzag", True, 8, travelling)}
                assert st.ops == flat[src]


def test_bytes_equal_the_flat_ring_up_to_the_accumulator_hops():
    kw = dict(batch=1, local_seq=64, q_heads=8, kv_heads=8, head_dim=32, dtype=torch.float32)
    for world, per_node in ((4, 2), (8, 4), (6, 3)):
        for backward in ("burst", "kv"):
            d = double_bytes(world_size=world, ranks_per_node=per_node, backward=backward, **kw)
            f = ring_bytes(world_size=world, backward=backward, **kw)
            assert d["forward"] == f["forward"]
            m = world // per_node
            acc = (64 * 8 * 32 * 4) * (2 if backward == "kv" else 1)
            assert d["backward"] - f["backward"] == m * acc  # the inner rings' extra hops home

"""The two-level ring (:func:`burstattn.engine.plan.two_level`, pure): every rank meets every block
exactly once, with the flat ring's ops for that pair; each inner step moves a block one hop inside the
node, each outer step one hop across nodes; the plans of every inner ring are consistent."""
from __future__ import annotations

import pytest
import torch

from burstattn.engine.bytes import double_bytes, ring_bytes
from burstattn.engine.pairs import ops_from_positions
from burstattn.engine.plan import check_plans, ring_source, two_level
from burstattn.layouts.named import local_positions

CASES = [(1, 1), (2, 1), (2, 2), (4, 2), (6, 3), (6, 2), (6, 1), (6, 6), (8, 4), (8, 2), (9, 3)]


@pytest.mark.parametrize("world,per_node", CASES)
@pytest.mark.parametrize("travelling", ["kv", "q"])
def test_every_block_once_and_hops_stay_local(world, per_node, travelling):
    pos = [local_positions(8 * world, r, world, "zigzag") for r in range(world)]
    ops_of = ops_from_positions(pos, pos, True)
    m_ = world // per_node
    for rank in range(world):
        nested = two_level(rank, world, per_node, ops_of, travelling)
        m, i = divmod(rank, per_node)
        srcs = []
        for d, inner in enumerate(nested.inner):
            for s, st in enumerate(inner.steps):
                (pr,) = st.pairs
                src = pr.k if travelling == "kv" else pr.q
                assert src == ring_source(m, d, m_) * per_node + ring_source(i, s, per_node)
                assert pr.ops == ops_of(pr.q, pr.k)  # the flat ring's ops of the same pair
                assert all(0 <= mv.peer < per_node for mv in st.fetch + st.give)  # inside the node
                srcs.append(src)
        assert sorted(srcs) == list(range(world))
        for st in nested.outer.steps:
            assert all(0 <= mv.peer < m_ for mv in st.fetch + st.give)  # one hop across nodes
    for d in range(m_):  # each inner ring (one node, one outer step) is consistent
        for m in range(m_):
            inner = [two_level(m * per_node + i, world, per_node, ops_of, travelling).inner[d]
                     for i in range(per_node)]
            check_plans(inner, ops_of)


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

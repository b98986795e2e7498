"""The ring's plans over the three layouts, checked without any process group: summed over every
(q_rank, k_rank) pair, the block ops from the layouts' positions cover exactly the global mask, each
entry once, also as the kernels run them; the ring visits every pair once; causal work is balanced
by zigzag and striped (counted on the plans, :func:`plan_cost`)."""
from __future__ import annotations

import itertools

import pytest
import torch

from burstattn.engine.pairs import MaskKind, ops_from_positions, position_ops
from burstattn.engine.compute import op_slices
from burstattn.engine.plan import plan_cost, ring, ring_source
from burstattn.layouts.named import local_positions

LAYOUTS = ["contiguous", "zigzag", "striped"]
WORLDS = [1, 2, 3, 4, 5, 8]


def op_mask(op, via_kernel: bool) -> torch.Tensor:
    """[n_q_slice, n_k_slice] visibility of one op, in the op's own coordinates.

    ``via_kernel``: as the engine runs it (op_slices: the kernel's causal mask j <= i on the
    sliced rows), else from the MaskKind's definition.
    """
    rows, cols = op.q_stop - op.q_start, op.k_stop - op.k_start
    mask = torch.zeros(rows, cols, dtype=torch.int64)
    if via_kernel:
        sl = op_slices(op)
        if sl is None:
            return mask
        qs, ks, causal = sl
        sub = torch.ones(qs.stop - qs.start, ks.stop - ks.start, dtype=torch.int64)
        if causal:
            assert sub.shape[0] == sub.shape[1], "the kernel's causal mask needs a square block"
            sub = sub.tril()
        mask[qs.start - op.q_start:qs.stop - op.q_start, ks.start - op.k_start:ks.stop - op.k_start] = sub
        return mask
    i = torch.arange(rows).unsqueeze(1)
    j = torch.arange(cols).unsqueeze(0)
    if op.mask is MaskKind.FULL:
        return torch.ones(rows, cols, dtype=torch.int64)
    if op.mask is MaskKind.CAUSAL:
        return (j <= i).long()
    return (j < i).long()


def covered(world, layout, causal, n, via_kernel) -> torch.Tensor:
    """How many times each (query, key) global pair is computed, summed over all block ops."""
    total = n * world
    count = torch.zeros(total, total, dtype=torch.int64)
    pos = [local_positions(total, r, world, layout) for r in range(world)]
    for qr, kr in itertools.product(range(world), repeat=2):
        for op in position_ops(pos[qr], pos[kr], causal):
            assert 0 <= op.q_start < op.q_stop <= n and 0 <= op.k_start < op.k_stop <= n, op
            qpos = pos[qr][op.q_start:op.q_stop]
            kpos = pos[kr][op.k_start:op.k_stop]
            count[qpos.unsqueeze(1), kpos.unsqueeze(0)] += op_mask(op, via_kernel)
    return count


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [2, 6])
@pytest.mark.parametrize("via_kernel", [False, True], ids=["maskkind", "kernel"])
def test_position_ops_cover_the_global_mask_exactly_once(layout, world, causal, n, via_kernel):
    total = n * world
    expected = torch.ones(total, total, dtype=torch.int64)
    if causal:
        expected = expected.tril()
    assert torch.equal(covered(world, layout, causal, n, via_kernel), expected)


@pytest.mark.parametrize("layout", ["contiguous", "striped"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_one_token_per_rank(layout, world):
    expected = torch.ones(world, world, dtype=torch.int64).tril()
    assert torch.equal(covered(world, layout, True, 1, via_kernel=True), expected)


@pytest.mark.parametrize("travelling", ["kv", "q"])
@pytest.mark.parametrize("world", WORLDS)
def test_ring_plan_visits_every_pair_once(travelling, world):
    pos = [local_positions(4 * world, r, world, "zigzag") for r in range(world)]
    ops_of = ops_from_positions(pos, pos, True)
    pairs = []
    for rank in range(world):
        plan = ring(rank, world, ops_of, travelling)
        assert [st.index for st in plan.steps] == list(range(world))
        assert [bool(st.fetch) for st in plan.steps] == [True] * (world - 1) + [False]  # the next block prefetched
        for st in plan.steps:
            (p,) = st.pairs
            mine, other = (p.q, p.k) if travelling == "kv" else (p.k, p.q)
            assert mine == rank and other == ring_source(rank, st.index, world) == (rank - st.index) % world, p
            assert p.ops == position_ops(pos[p.q], pos[p.k], True)
            pairs.append((p.q, p.k))
    assert sorted(pairs) == sorted(itertools.product(range(world), repeat=2))


def rank_costs(world: int, layout: str, causal: bool, n: int) -> list[float]:
    """Score entries each rank's forward ring plan computes."""
    pos = [local_positions(n * world, r, world, layout) for r in range(world)]
    ops_of = ops_from_positions(pos, pos, causal)
    return [plan_cost(ring(r, world, ops_of, "kv")) for r in range(world)]


@pytest.mark.parametrize("layout", ["zigzag", "striped"])
@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_balanced_layouts_give_every_rank_equal_causal_work(layout, world):
    n = 16
    costs = rank_costs(world, layout, True, n)
    assert max(costs) - min(costs) <= n, costs  # striped: at most one row per block apart
    assert sum(costs) == pytest.approx(sum(rank_costs(world, layout, False, n)) / 2, rel=0.1)


def test_contiguous_causal_is_imbalanced():
    costs = rank_costs(4, "contiguous", True, 8)
    assert costs == sorted(costs) and costs[-1] > 3 * costs[0]

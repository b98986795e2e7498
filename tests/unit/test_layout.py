"""Layouts as pure functions: every global position is held by exactly one rank."""
from __future__ import annotations

import pytest
import torch

import burstattn
from burstattn.layouts.named import local_positions

LAYOUTS = ["contiguous", "zigzag", "striped"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("per_chunk", [1, 3])
def test_positions_are_a_permutation(layout, world, per_chunk):
    n = 2 * world * per_chunk
    parts = [local_positions(n, r, world, layout) for r in range(world)]
    for p in parts:
        assert p.dtype == torch.int64 and p.shape == (n // world,)
        assert bool((p[1:] > p[:-1]).all()), "positions held by a rank must increase"
    assert torch.equal(torch.cat(parts).sort().values, torch.arange(n))


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_layout_definitions(world):
    n, c = 4 * world, 2
    for r in range(world):
        assert torch.equal(local_positions(n, r, world, "contiguous"), torch.arange(r * 4, r * 4 + 4))
        assert torch.equal(local_positions(n, r, world, "striped"), torch.arange(r, n, world))
        far = 2 * world - 1 - r
        assert local_positions(n, r, world, "zigzag").tolist() == [r * c, r * c + 1, far * c, far * c + 1]


@pytest.mark.parametrize("layout,n,world", [("zigzag", 6, 2), ("zigzag", 4, 4), ("striped", 7, 2),
                                            ("contiguous", 10, 4), ("contiguous", 0, 1)])
def test_unsplittable_lengths_raise(layout, n, world):
    with pytest.raises(ValueError, match=f"sequence length {n}"):
        local_positions(n, 0, world, layout)


def test_unknown_layout_and_rank_raise():
    with pytest.raises(ValueError, match="layout"):
        local_positions(8, 0, 2, "spiral")
    with pytest.raises(ValueError, match="rank"):
        local_positions(8, 2, 2, "zigzag")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_world_of_one_without_a_group(layout):
    """No process group: the world is this process; shard/gather are identities."""
    x = torch.randn(2, 12, 4, requires_grad=True)
    assert torch.equal(burstattn.sequence_positions(12, layout=layout), torch.arange(12))
    assert torch.equal(burstattn.shard_sequence(x, layout=layout), x)
    assert torch.equal(burstattn.gather_sequence(x, layout=layout), x)
    assert torch.equal(burstattn.shard_sequence(x, layout=layout, dim=-1), x)
    with pytest.raises(ValueError, match="group"):
        burstattn.shard_sequence(x, group=object(), layout=layout)

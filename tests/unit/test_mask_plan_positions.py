"""Masks plan from positions, like every dense plan: one producer of block ops.

A masked call's plan is ``build_plan`` over the ranks' positions with the mask's block summary
(``MaskBlocks``) as the producer, on the sparse schedule derived from the non-empty pairs. Checked
against the dense producer (``position_ops``) on the same schedule: a mask that hides nothing gives the
dense plan, and a block-diagonal mask (documents of two ranks each) drops exactly the pairs across
documents, their ops and their transfers, at worlds 1-5 (odd ones included). Pure: no process group.
"""
from __future__ import annotations

import pytest
import torch

from burstattn.engine.direct import sparse_steps
from burstattn.engine.pairs import ops_from_positions, position_ops
from burstattn.engine.plan import Pair, check_plans
from burstattn.engine.run import build_plan
from burstattn.layouts.named import local_positions
from burstattn.masks import AttnMask, mask_bytes, mask_plan
from burstattn.masks.blocks import mask_blocks

WORLDS = [1, 2, 3, 4, 5]
SHARD = 8  # tokens per rank; tiles of 4 rows, so a shard's pair has several tiles


def _positions(n: int, world: int, layout: str) -> list:
    return [local_positions(n, r, world, layout) for r in range(world)]


def _cells(ops, nq: int, nk: int) -> torch.Tensor:
    """The (query row, key row) entries a pair's ops compute, as a ``[nq, nk]`` 0/1 count."""
    out = torch.zeros(nq, nk, dtype=torch.long)
    for op in ops:
        block = torch.ones(op.q_stop - op.q_start, op.k_stop - op.k_start, dtype=torch.long)
        if op.mask.value in ("causal", "strict"):
            block = block.tril(0 if op.mask.value == "causal" else -1)
        out[op.q_start:op.q_stop, op.k_start:op.k_stop] += block
    return out


def _canonical(plan, shard: int) -> tuple:
    """The plan with each pair's ops replaced by the entries they compute (the dense producer makes one
    CAUSAL op where a mask's tiles make a FULL run and a CAUSAL tile per row: the same entries)."""
    def pair(pr: Pair):
        return pr.q, pr.k, tuple(map(tuple, _cells(pr.ops, shard, shard).tolist()))
    return (plan.rank, plan.world_size, plan.own, plan.channels,
            tuple((st.index, tuple(map(pair, st.pairs)), st.fetch, st.give) for st in plan.steps))


def _plans(world, pos, causal, travelling, blocks=None, schedule="sparse"):
    return [build_plan(r, world, positions=pos, causal=causal, travelling=travelling, schedule=schedule,
                       blocks=blocks) for r in range(world)]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize("travelling", ["kv", "q"])
def test_a_mask_that_hides_nothing_gives_the_dense_plan(world, layout, travelling):
    n = SHARD * world
    pos = _positions(n, world, layout)
    summary = mask_blocks(AttnMask(block_size=4), n)
    # without causal both producers make one FULL op per pair: the plan objects are equal
    dense = _plans(world, pos, False, travelling)
    assert _plans(world, pos, False, travelling, summary) == dense
    check_plans(dense, ops_from_positions(pos, pos, False), sides=(travelling,))
    # causal: the same steps, pairs and transfers, each pair computing the same entries
    dense = _plans(world, pos, True, travelling)
    masked = _plans(world, pos, True, travelling, summary)
    assert [_canonical(p, SHARD) for p in masked] == [_canonical(p, SHARD) for p in dense]
    # the all-gather's one step over every rank's K/V, likewise
    assert ([_canonical(p, SHARD) for p in _plans(world, pos, True, travelling, summary, "gathered")]
            == [_canonical(p, SHARD) for p in _plans(world, pos, True, travelling, None, "gathered")])


def _doc(position: int) -> int:
    return position // (2 * SHARD)  # documents of two contiguous shards each (the last one may be short)


def _same_document(q_pos, k_pos, causal):
    """The dense producer restricted to the pairs of one document (the oracle of a block-diagonal mask)."""
    return position_ops(q_pos, k_pos, causal) if _doc(int(q_pos[0])) == _doc(int(k_pos[0])) else ()


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("travelling", ["kv", "q"])
def test_a_block_diagonal_mask_drops_exactly_the_empty_pairs_and_their_traffic(world, causal, travelling):
    n = SHARD * world
    pos = _positions(n, world, "contiguous")
    mask = AttnMask(cu_seqlens=list(range(0, n, 2 * SHARD)) + [n], block_size=4)
    masked = _plans(world, pos, causal, travelling, mask_blocks(mask, n))
    oracle = _plans(world, pos, causal, travelling, _same_document)
    if causal:
        assert [_canonical(p, SHARD) for p in masked] == [_canonical(p, SHARD) for p in oracle]
    else:
        assert masked == oracle
    check_plans(masked, ops_from_positions(pos, pos, causal, mask_blocks(mask, n)), sides=(travelling,))
    # against the dense plan on the same schedule: the pairs across documents and their moves go, no other
    dense = _plans(world, pos, causal, travelling)
    needed = {(q, k) for q in range(world) for k in range(world) if _doc(q * SHARD) == _doc(k * SHARD)
              and (k <= q or not causal)}

    def pairs(plans):
        return {(pr.q, pr.k) for p in plans for st in p.steps for pr in st.pairs if pr.ops}

    def moves(plans):  # (sender, receiver) of the travelling data
        return {(p.rank, mv.peer) for p in plans for st in p.steps for mv in st.fetch if mv.send}
    assert pairs(masked) == needed and needed <= pairs(dense)
    side = {"kv": lambda q, k: (k, q), "q": lambda q, k: (q, k)}[travelling]  # who sends to whom
    assert moves(masked) == {side(q, k) for q, k in needed if q != k}
    assert moves(masked) <= moves(dense)
    # the byte formula counts the same readers and sources the plans move data for
    shape = dict(batch=1, local_seq=SHARD, q_heads=2, kv_heads=1, head_dim=4, dtype=torch.float32)
    for r in range(world):
        mp = mask_plan(mask, causal, n, world, "contiguous", r)
        assert set(mp.readers) == {q for q, k in needed if k == r and q != r}
        kv_block = 1 * SHARD * 1 * (4 + 4) * 4  # B * n * Hkv * (d + d_v) float32 elements, 4 bytes each
        assert mask_bytes(mp, backward="kv", **shape)["ops"][("forward", "kv")] == len(mp.readers) * kv_block
        steps = mp.kv_steps() if travelling == "kv" else mp.q_steps()
        assert steps == sparse_steps(r, world, ops_from_positions(pos, pos, causal, _same_document), travelling)


def test_the_mask_plan_keyword_is_the_summary_on_the_sparse_schedule():
    """``build_plan(mask_plan=...)`` (the former spelling) is the plan of the summary the mask plan holds:
    the same memoised object; and a summary built once serves every rank's plan (cached in the mask)."""
    world, n = 3, 3 * SHARD
    pos = _positions(n, world, "zigzag")
    mask = AttnMask(window=(5, 0), block_size=4)
    for r in range(world):
        mp = mask_plan(mask, True, n, world, "zigzag", r)
        by_summary = build_plan(r, world, positions=pos, causal=True, travelling="q", schedule="sparse",
                                blocks=mp.blocks)
        assert build_plan(r, world, positions=pos, causal=True, travelling="q", mask_plan=mp) is by_summary
        assert [pr.ops for st in by_summary.steps for pr in st.pairs if pr.q == r] == \
            [mp.row[pr.k] for st in by_summary.steps for pr in st.pairs if pr.q == r]
    assert len([key for key in mask.cache if key[0] == "ops"]) == world * world  # each pair once


def test_an_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match="schedule"):
        build_plan(0, 2, positions=_positions(16, 2, "contiguous"), causal=True, travelling="kv", schedule="rign")

"""The mask summary, op compiler and sparse plans, checked against brute force (pure, no ranks)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from burstattn.engine.bytes import ring_bytes
from burstattn.engine.pairs import MaskKind
from burstattn.layouts.named import local_positions
from burstattn.masks import AttnMask, balance, choose_mask_backward, mask_bytes, mask_plan, pair_ops, rank_work
from burstattn.masks.blocks import CAUSAL, EMPTY, FULL, PARTIAL, STRICT, classify


def _dense(mask, causal, n, world, layout, qr, kr):
    qp, kp = (local_positions(n, r, world, layout) for r in (qr, kr))
    return mask.dense(qp, kp, n, causal)


def _rebuild(ops, shape, dense):
    """The mask the ops compute, and how many ops touch each entry."""
    got = torch.zeros(shape, dtype=torch.bool)
    hits = torch.zeros(shape, dtype=torch.int64)
    for op in ops:
        qs, ks = slice(op.q_start, op.q_stop), slice(op.k_start, op.k_stop)
        h, w = op.q_stop - op.q_start, op.k_stop - op.k_start
        blk = {MaskKind.FULL: torch.ones(h, w, dtype=torch.bool),
               MaskKind.CAUSAL: torch.ones(h, w, dtype=torch.bool).tril(),
               MaskKind.STRICT: torch.ones(h, w, dtype=torch.bool).tril(-1),
               MaskKind.PARTIAL: dense[qs, ks]}[op.mask]
        got[qs, ks] |= blk
        hits[qs, ks] += 1
    return got, hits


def mod_local_global(q, k):
    return (q // 5 == k // 5) | (k < 2)


MASKS = [
    dict(window=(3, 1)), dict(window=(0, 0)), dict(window=(None, 2)), dict(window=(7, None)),
    dict(cu_seqlens=[0, 1, 9, 10, 30, 48]), dict(cu_seqlens=[0, 48]), dict(cu_seqlens=[0, 24, 48], window=(4, 4)),
    dict(mask_mod=mod_local_global), dict(mask_mod=mod_local_global, window=(6, 0)),
]


@pytest.mark.parametrize("kw", MASKS, ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("tile", [3, 5, 64])
def test_ops_compute_exactly_the_mask_once(kw, layout, causal, tile):
    world, n = 3, 48
    mask = AttnMask(block_size=tile, **kw)
    for qr in range(world):
        for kr in range(world):
            dense = _dense(mask, causal, n, world, layout, qr, kr)
            ops = pair_ops(mask, causal, n, world, layout, qr, kr)
            got, hits = _rebuild(ops, dense.shape, dense)
            assert torch.equal(got, dense)
            assert int(hits.max()) <= 1, "an entry is computed twice"
            assert bool(dense.any()) == bool(ops), "empty pairs have no ops, non-empty ones have some"


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 6), st.integers(0, 9), st.integers(0, 9), st.booleans(), st.integers(1, 4))
def test_tile_classes_against_brute_force(tile, left, right, causal, docs):
    n = 24
    cuts = sorted({0, n} | {(7 * i + 3) % n for i in range(docs)})
    mask = AttnMask(window=(left, right), cu_seqlens=cuts, block_size=tile)
    pos = torch.arange(n)
    cls = classify(mask, pos, pos, n, causal)
    dense = mask.dense(pos, pos, n, causal)
    for i in range(cls.shape[0]):
        for j in range(cls.shape[1]):
            blk = dense[i * tile:(i + 1) * tile, j * tile:(j + 1) * tile]
            want = EMPTY if not blk.any() else FULL if blk.all() else PARTIAL
            c = int(cls[i, j])
            if c in (CAUSAL, STRICT):
                tri = torch.ones_like(blk).tril(0 if c == CAUSAL else -1)
                assert want == PARTIAL and torch.equal(blk, tri)
            else:
                assert c == want


def test_dense_causal_diagonal_is_one_causal_call_per_tile_row():
    mask = AttnMask(cu_seqlens=[0, 64], block_size=16)  # one document: plain causal
    ops = pair_ops(mask, True, 64, 1, "contiguous", 0, 0)
    assert [op.mask for op in ops if op.mask is not MaskKind.FULL] == [MaskKind.CAUSAL] * 4
    assert not any(op.mask is MaskKind.PARTIAL for op in ops)


def test_full_region_merges_into_one_call():
    mask = AttnMask(window=(1000, 1000), block_size=4)  # wider than the sequence: dense
    assert pair_ops(mask, False, 64, 2, "contiguous", 0, 1) == pair_ops(mask, False, 64, 2, "contiguous", 1, 0)
    (op,) = pair_ops(mask, False, 64, 2, "contiguous", 0, 1)
    assert (op.q_start, op.q_stop, op.k_start, op.k_stop, op.mask) == (0, 32, 0, 32, MaskKind.FULL)


def test_summary_is_cached_and_mask_mod_runs_once():
    calls = []

    def mod(q, k):
        calls.append(1)
        return (q + k) % 2 == 0

    mask = AttnMask(mask_mod=mod, block_size=8)
    first = pair_ops(mask, True, 64, 2, "zigzag", 1, 0)
    count = len(calls)
    assert count > 0 and pair_ops(mask, True, 64, 2, "zigzag", 1, 0) is first and len(calls) == count


@pytest.mark.parametrize("world", [2, 3, 5, 8])
@pytest.mark.parametrize("kw", [dict(window=(5, 0)), dict(cu_seqlens=[0, 3, 40, 41, 80]), dict(window=(0, 30)),
                                dict(mask_mod=mod_local_global)], ids=str)
def test_plans_pair_every_send_with_a_receive(world, kw):
    n = 16 * world if world != 5 else 80
    mask = AttnMask(block_size=4, **kw)
    if kw.get("cu_seqlens") and kw["cu_seqlens"][-1] != n:
        mask = AttnMask(block_size=4, cu_seqlens=[0, 3, n // 2, n // 2 + 1, n])
    plans = [mask_plan(mask, True, n, world, "contiguous", r) for r in range(world)]
    for steps_of in ("kv_steps", "q_steps"):
        sends, recvs = set(), set()
        for r, p in enumerate(plans):
            for s in getattr(p, steps_of)():
                if s.kv_to is not None:
                    sends.add((s.step, r, s.kv_to))
                if s.q_to is not None:
                    sends.add((s.step, r, s.q_to))
                if s.own_k is not None and s.own_k != r:
                    recvs.add((s.step, s.own_k, r))
                if s.helper_q is not None:
                    recvs.add((s.step, s.helper_q, r))
        assert sends == recvs
    for r, p in enumerate(plans):
        assert set(p.sources) == {s for s in range(world) if s != r and plans[s].col[r]}


def test_dense_plan_bytes_match_the_ring_forward():
    world, n = 4, 64
    mask = AttnMask(window=(10 * n, 10 * n))
    shape = dict(batch=2, local_seq=n // world, q_heads=8, kv_heads=2, head_dim=16, dtype=torch.bfloat16)
    for r in range(world):
        plan = mask_plan(mask, False, n, world, "zigzag", r)
        got = mask_bytes(plan, backward="kv", **shape)
        ring = ring_bytes(world_size=world, backward="kv", **shape)
        assert got["forward"] == ring["forward"]
        kv_block = 2 * 2 * 16 * 2 * 16
        assert ring["backward"] - got["backward"] == kv_block * 4  # the ring's dK/dV hop home


def test_window_bytes_and_balance():
    world, n = 4, 4096
    mask = AttnMask(window=(n // 8, 0))
    plans = [mask_plan(mask, True, n, world, "contiguous", r) for r in range(world)]
    assert [p.readers for p in plans] == [(1,), (2,), (3,), ()]
    assert [p.sources for p in plans] == [(), (0,), (1,), (2,)]
    work = rank_work(mask, True, n, world, "contiguous")
    dense = rank_work(AttnMask(window=(10 * n, 0)), True, n, world, "contiguous")
    assert sum(work) < 0.3 * sum(dense) and balance(work) < 1.2 and balance(dense) > 1.5


def test_backward_choice_follows_the_shape():
    kw = dict(batch=1, local_seq=128, head_dim=64, dtype=torch.float32)
    assert choose_mask_backward(q_heads=8, kv_heads=8, **kw) == "burst"
    assert choose_mask_backward(q_heads=8, kv_heads=2, **kw) == "kv"


@pytest.mark.parametrize("kw,needle", [
    (dict(window=(-2, 0)), "window left"), (dict(window=(1, 2, 3)), "pair"), (dict(window=(1, 0.5)), "right"),
    (dict(cu_seqlens=[0, 4, 4, 8]), "strictly increasing"), (dict(cu_seqlens=[[0, 8]]), "1-D"),
    (dict(document_ids=[1, 1, 2, 1]), "contiguous run"), (dict(mask_mod="x"), "callable"),
    (dict(block_size=0), "block_size"),
])
def test_bad_masks(kw, needle):
    with pytest.raises(ValueError, match=needle):
        AttnMask(**kw)


def test_cu_seqlens_must_end_at_the_sequence():
    assert "must end at the global sequence length 64" in AttnMask(cu_seqlens=[0, 10, 60]).problem(64)
    assert AttnMask(cu_seqlens=[0, 10, 64]).problem(64) is None

"""Document-aware partitions as pure functions: validity, balance, whole documents, errors."""
from __future__ import annotations

import struct
import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from burstattn.layouts.named import local_positions
from burstattn.layouts.partition import (Partition, balance, document_partition, document_spread, layout_positions,
                                         partition_work, token_work)

WINDOWS = [None, (0, 0), (2, 1), (3, None), (None, 2)]


def random_cu(seed: int, seq_len: int, docs: int) -> list[int]:
    """``docs`` documents of random lengths: uniform cut points of ``[0, seq_len)``."""
    g = torch.Generator().manual_seed(seed)
    cuts = (torch.randperm(seq_len - 1, generator=g)[:docs - 1] + 1).sort().values
    return [0, *cuts.tolist(), seq_len]


def lognormal_cu(seed: int, seq_len: int, mean_len: int) -> list[int]:
    """Heavy-tailed document lengths (a few long documents among many short ones)."""
    g = torch.Generator().manual_seed(seed)
    cu = [0]
    while cu[-1] < seq_len:
        length = max(1, int(torch.empty(1).log_normal_(0.0, 1.5, generator=g).item() * mean_len))
        cu.append(min(seq_len, cu[-1] + length))
    return cu


def assert_valid(part: Partition, seq_len: int, world: int) -> None:
    assert (part.world_size, part.seq_len, part.local_len) == (world, seq_len, seq_len // world)
    for r in range(world):
        p = part.positions_of(r)
        assert p.dtype == torch.int64 and p.shape == (seq_len // world,)
        assert bool((p[1:] > p[:-1]).all()), "positions held by a rank must increase"
    assert torch.equal(torch.cat(part.positions).sort().values, torch.arange(seq_len))


def dense_work(seq_len: int, cu: list[int], causal: bool, window) -> torch.Tensor:
    """Keys per query counted on the dense [N, N] mask."""
    doc = torch.bucketize(torch.arange(seq_len), torch.tensor(cu[1:]), right=True)
    i, j = torch.arange(seq_len)[:, None], torch.arange(seq_len)[None, :]
    mask = doc[:, None] == doc[None, :]
    if causal:
        mask &= j <= i
    if window is not None and window[0] is not None:
        mask &= j >= i - window[0]
    if window is not None and window[1] is not None:
        mask &= j <= i + window[1]
    return mask.sum(1).double()


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("cu", [None, [0, 5, 6, 13, 20], [0, 1, 2, 20]])
def test_token_work_matches_dense_count(cu, causal, window):
    expected = dense_work(20, cu or [0, 20], causal, window)
    got = token_work(20, causal=causal, cu_seqlens=cu, window=window)
    assert got.dtype == torch.float64 and torch.equal(got, expected)


def test_token_work_formulas():
    cu = [0, 3, 7]
    assert token_work(7, causal=True, cu_seqlens=cu).tolist() == [1, 2, 3, 1, 2, 3, 4]
    assert token_work(7, causal=False, cu_seqlens=cu).tolist() == [3, 3, 3, 4, 4, 4, 4]
    assert token_work(4, causal=True).tolist() == [1, 2, 3, 4]


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.integers(1, 80), min_size=1, max_size=24),
       world=st.sampled_from([1, 2, 3, 4, 8]), causal=st.booleans(),
       window=st.sampled_from([None, (16, 0), (8, 8)]), tolerance=st.sampled_from([0.0, 0.01, 0.2]))
def test_partition_is_valid_for_random_documents(lengths, world, causal, window, tolerance):
    pad = -sum(lengths) % world
    lengths = lengths + [pad] if pad else lengths
    cu = torch.tensor([0, *lengths]).cumsum(0)
    seq_len = int(cu[-1])
    part = document_partition(cu, world, causal=causal, window=window, tolerance=tolerance)
    assert_valid(part, seq_len, world)
    work = token_work(seq_len, causal=causal, cu_seqlens=cu, window=window)
    assert float(partition_work(part, work).sum()) == float(work.sum())
    again = document_partition(cu.tolist(), world, causal=causal, window=window, tolerance=tolerance)
    assert again.fingerprint == part.fingerprint, "the partition must be deterministic"
    assert int(document_spread(part, cu).max()) <= world


def layout_balance(layout: str, seq_len: int, world: int, work: torch.Tensor) -> float:
    return balance(partition_work(layout_positions(layout, seq_len, world), work))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seed", range(5))
def test_balance_beats_named_layouts_on_skewed_documents(seed, causal):
    seq_len, world = 32768, 4
    cu = random_cu(seed, seq_len, 8)
    work = token_work(seq_len, causal=causal, cu_seqlens=cu)
    part = document_partition(cu, world, causal=causal)
    ours = balance(partition_work(part, work))
    assert ours <= 1.011, "default tolerance 0.01: every rank within 1 % of the mean"
    assert ours < layout_balance("contiguous", seq_len, world, work)
    assert ours < layout_balance("zigzag", seq_len, world, work)
    exact = document_partition(cu, world, causal=causal, tolerance=0.0)
    assert balance(partition_work(exact, work)) <= 1.001
    # both runs of every rank cut at most one document each: at most 2 new pieces per rank boundary
    assert int(document_spread(part, cu).sum()) <= len(cu) - 1 + 2 * (world - 1)


@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, (1024, 0)),
                                           (False, (256, 256))])
def test_many_documents_many_ranks(causal, window):
    seq_len, world = 1 << 16, 32
    cu = lognormal_cu(1, seq_len, 150)
    work = token_work(seq_len, causal=causal, cu_seqlens=cu, window=window)
    part = document_partition(cu, world, causal=causal, window=window)
    assert_valid(part, seq_len, world)
    assert balance(partition_work(part, work)) <= 1.011
    spread = document_spread(part, cu)
    zigzag_spread = document_spread(layout_positions("zigzag", seq_len, world), cu)
    assert int(spread.sum()) < int(zigzag_spread.sum())


@pytest.mark.parametrize("world", [2, 4, 8])
def test_single_document_is_zigzag_balanced(world):
    seq_len = 4096
    work = token_work(seq_len, causal=True)
    part = document_partition([0, seq_len], world, causal=True)
    assert balance(partition_work(part, work)) == pytest.approx(1.0, abs=1e-9)
    assert layout_balance("zigzag", seq_len, world, work) == pytest.approx(1.0, abs=1e-9)
    for p in part.positions:  # zigzag inside the document: position i pairs with N-1-i
        assert torch.equal((seq_len - 1 - p).flip(0), p)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("lengths,world", [([1024] * 8, 4), ([2048] * 4, 4), ([512] * 16, 4),
                                           ([1024] * 4 + [512] * 8, 4), ([4096] * 8, 8)])
def test_documents_stay_whole_when_a_perfect_packing_exists(lengths, world, causal):
    cu = torch.tensor([0, *lengths]).cumsum(0)
    seq_len = int(cu[-1])
    part = document_partition(cu, world, causal=causal)
    assert torch.equal(document_spread(part, cu), torch.ones(len(lengths), dtype=torch.int64))
    work = token_work(seq_len, causal=causal, cu_seqlens=cu)
    assert balance(partition_work(part, work)) == 1.0


def test_tensor_and_list_cu_seqlens_agree():
    cu = random_cu(3, 4096, 6)
    a = document_partition(cu, 4)
    b = document_partition(torch.tensor(cu, dtype=torch.int32), 4)
    assert a.fingerprint == b.fingerprint


@pytest.mark.parametrize("cu,match", [
    ([1, 4, 8], "must start at 0, got cu_seqlens\\[0\\] = 1"),
    ([0, 4, 4, 8], "strictly increasing, got cu_seqlens\\[2\\] = 4 <= cu_seqlens\\[1\\] = 4"),
    ([0, 5, 3, 8], "strictly increasing"), ([0], "at least 2 entries"), ([0, 2.5, 8], "must hold ints"),
    (torch.tensor([0.0, 8.0]), "integer tensor"), (torch.zeros(2, 2, dtype=torch.long), "1-D integer tensor"),
])
def test_bad_cu_seqlens_raise(cu, match):
    with pytest.raises((ValueError, TypeError), match=match):
        document_partition(cu, 2)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="must end at seq_len = 8, got cu_seqlens\\[-1\\] = 6"):
        token_work(8, causal=True, cu_seqlens=[0, 3, 6])
    with pytest.raises(ValueError, match="N = cu_seqlens\\[-1\\] = 10 cannot be split over world_size = 4"):
        document_partition([0, 3, 10], 4)
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        document_partition([0, 8], 0)
    with pytest.raises(ValueError, match="window left must be an int >= 0"):
        document_partition([0, 8], 2, window=(-2, 0))  # -1 is flash-attn's "unbounded"
    with pytest.raises(ValueError, match="pair"):
        token_work(8, causal=True, window=(1, 2, 3))
    with pytest.raises(ValueError, match="tolerance"):
        document_partition([0, 8], 2, tolerance=1.5)
    with pytest.raises(ValueError, match="seq_len must be a positive int"):
        token_work(0, causal=True)


@pytest.mark.parametrize("positions,match", [
    ((torch.tensor([0, 1]), torch.tensor([1, 2])), "disjoint and cover"),
    ((torch.tensor([0, 1]), torch.tensor([2])), "same positive number"),
    ((torch.tensor([1, 0]), torch.tensor([2, 3])), "positions\\[0\\] must be strictly increasing"),
    ((torch.tensor([0, 1]), torch.tensor([2, 4])), "disjoint and cover"),
    ((torch.tensor([0.0, 1.0]),), "1-D integer tensor"),
    ((), "non-empty"),
])
def test_invalid_partitions_raise(positions, match):
    with pytest.raises(ValueError, match=match):
        Partition(positions)


def test_fingerprint_identifies_the_partition():
    parts = [torch.tensor([0, 3]), torch.tensor([1, 2])]
    a, b = Partition(tuple(parts)), Partition((torch.tensor([0, 3]), torch.tensor([1, 2])), name="other")
    assert a.fingerprint == b.fingerprint
    assert Partition((torch.tensor([0, 2]), torch.tensor([1, 3]))).fingerprint != a.fingerprint
    two = Partition(tuple(torch.arange(8).view(2, 4)))
    four = Partition(tuple(torch.arange(8).view(4, 2)))  # same bytes, other split
    assert two.fingerprint != four.fingerprint
    # the documented definition (no Python hash): equal in every process
    raw = struct.pack("<qq", 2, 2) + struct.pack("<4q", 0, 3, 1, 2)
    assert a.fingerprint == zlib.crc32(raw)
    assert repr(a) == ("Partition(name='documents', world_size=2, seq_len=4, "
                       f"fingerprint={a.fingerprint:#010x})")


def test_layout_positions_and_partition_work():
    named = layout_positions("zigzag", 16, 4)
    assert all(torch.equal(p, local_positions(16, r, 4, "zigzag")) for r, p in enumerate(named))
    part = Partition(tuple(named), name="zigzag")
    assert all(torch.equal(p, q) for p, q in zip(layout_positions(part, 16, 4), named))
    with pytest.raises(ValueError, match="does not match seq_len = 32, world_size = 4"):
        layout_positions(part, 32, 4)
    with pytest.raises(TypeError, match="layout name or a Partition"):
        layout_positions(3, 16, 4)
    work = torch.arange(16, dtype=torch.float64)
    assert partition_work(part, work).tolist() == [float(work[p].sum()) for p in named]
    assert partition_work(named, work).dtype == torch.float64
    with pytest.raises(ValueError, match="hold 16 tokens but work has 8"):
        partition_work(part, work[:8])
    assert balance([1.0, 1.0, 2.0]) == pytest.approx(1.5)
    with pytest.raises(ValueError, match="positive sum"):
        balance([])
    with pytest.raises(ValueError, match="rank must be in"):
        part.positions_of(4)


def test_document_spread_counts_ranks_per_document():
    cu = [0, 4, 8, 16]
    assert document_spread(layout_positions("contiguous", 16, 4), cu).tolist() == [1, 1, 2]
    assert document_spread(layout_positions("striped", 16, 4), cu).tolist() == [4, 4, 4]

"""The cut of document_partition / mask_partition on Python floats (few units per rank) and on tensors
(long runs) choose the same sizes; mask_partition's and document_partition's partitions are those of the
code before that change (fingerprints recorded at commit 9d5cb5a, before the scalar cut, the merged pair
spans, the binary-search pair table and the one-pass Partition check); the merged spans count the same pairs."""
from __future__ import annotations

import pytest
import torch

from burstattn.layouts.cut import _cut
from burstattn.layouts.partition import Partition, _stream, document_partition, token_work
from burstattn.masks import AttnMask
from burstattn.masks.partition_solver import BlockSummary, solve_partition, touching_pairs


def lognormal_cu(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    out, at = [0], 0
    while at < n:
        length = int(torch.exp(torch.randn(1, generator=g) * 1.2 + 5.5).clamp(8, n // 3))
        at = min(n, at + length)
        out.append(at)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_scalar_cut_equals_the_tensor_cut(seed):
    """Token-level documents (swaps of whole documents happen) and short block streams, over a few worlds."""
    g = torch.Generator().manual_seed(seed)
    world = int(torch.randint(2, 9, (1,), generator=g))
    n = world * int(torch.randint(4, 40, (1,), generator=g))
    cu = torch.tensor(lognormal_cu(n, seed)) if seed % 2 else torch.tensor([0, n])
    work = token_work(n, causal=True, cu_seqlens=cu, window=(int(torch.randint(5, 60, (1,), generator=g)), 0)
                      if seed % 3 == 0 else None)
    stream, boundary = _stream(cu, work, fold=True)
    for swaps in (True, False):
        tensor = _cut(stream, work[stream], boundary, world, 0.01, allow_swaps=swaps, scalar_units=0)
        scalar = _cut(stream, work[stream], boundary, world, 0.01, allow_swaps=swaps, scalar_units=10 ** 9)
        assert all(torch.equal(a, b) for a, b in zip(tensor, scalar)), (seed, swaps)


N = 1 << 16
# (mask, N, P, tile, kept candidate, fingerprint, balance, touching pairs), from commit 9d5cb5a (a mask_mod
# goes through the same cut; its tile classes, unchanged, cost seconds even at 512 tokens: left out)
BEFORE = [
    (dict(), N, 64, 256, "layout-zigzag", 4148995138, 1.0000000343366409, 4032),
    (dict(window=(N // 8, 0)), N, 64, 256, "layout-contiguous", 4068218237, 1.066666668475031, 476),
    (dict(window=(N // 32, 0)), N, 64, 256, "layout-contiguous", 4068218237, 1.0158730155662745, 125),
    (dict(cu_seqlens=lognormal_cu(N, 1)), N, 64, 64, "sorted", 59386755, 1.1324205289596674, 3429),
    (dict(cu_seqlens=lognormal_cu(N, 2), window=(300, 0)), N, 32, 64, "contiguous", 1479700999, 1.0237776448232554, 61),
]


@pytest.mark.parametrize("case", BEFORE, ids=lambda c: ",".join(c[0]) or "causal")
def test_mask_partition_unchanged(case):
    kw, n, world, tile, name, fingerprint, bal, pairs = case
    sol = solve_partition(AttnMask(block_size=tile, **kw), n, world, causal=True)
    assert (sol.candidate, sol.partition.fingerprint, sol.balance, sol.pairs) == (name, fingerprint, bal, pairs)


@pytest.mark.parametrize("seed,fingerprint", [(1, 2410940245), (2, 4097893997)])
def test_document_partition_unchanged(seed, fingerprint):
    assert document_partition(lognormal_cu(1 << 15, seed + 10), 8).fingerprint == fingerprint


def test_merged_spans_count_the_pairs_of_every_block():
    """touching_pairs (spans merged per rank) against a brute force over every block and key tile."""
    g = torch.Generator().manual_seed(3)
    for trial in range(60):
        p, per = int(torch.randint(1, 7, (1,), generator=g)), int(torch.randint(1, 6, (1,), generator=g))
        b = p * per
        owner = torch.randperm(b, generator=g) % p if trial % 2 else torch.arange(b) // per
        lo = torch.randint(0, b, (b,), generator=g)
        hi = (lo + torch.randint(-3, b // 2 + 1, (b,), generator=g)).clamp(max=b - 1)
        summary = BlockSummary(1, torch.zeros(b, dtype=torch.float64), lo, hi, None)
        need = torch.zeros(p, p, dtype=torch.bool)
        for i in range(b):
            for j in range(int(lo[i]), int(hi[i]) + 1):
                need[owner[i], owner[j]] = True
        need.fill_diagonal_(False)
        assert touching_pairs(summary, owner, owner, p) == int(need.sum()), trial


@pytest.mark.parametrize("positions,match", [
    ((torch.tensor([0, 2]), torch.tensor([3, 1])), "positions\\[1\\] must be strictly increasing"),
    ((torch.tensor([0, 1]), torch.tensor([1, 2])), "must be disjoint and cover arange\\(4\\)"),
    ((torch.tensor([0, 5]), torch.tensor([1, 2])), "must be disjoint and cover arange\\(4\\)"),
    ((torch.tensor([-1, 0]), torch.tensor([1, 2])), "must be disjoint and cover arange\\(4\\)"),
    ((torch.tensor([0, 1]), torch.tensor([2])), "the same positive number of tokens"),
])
def test_partition_check_in_one_pass_refuses(positions, match):
    with pytest.raises(ValueError, match=match):
        Partition(positions)

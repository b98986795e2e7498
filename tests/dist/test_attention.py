"""burst_attn_func against the float64 dense oracle on the full sequence, over a grid.

Every rank builds the same full random q/k/v/grad_out from a seed and shards them with
shard_sequence; the parent reassembles out, lse, dq, dk, dv from the ranks and compares with
exact_attention (autograd in float64), by the tolerance rule of tests/helpers.py: relative
Frobenius error <= 1e-5 (float32); bfloat16 within flash-attn's rule (2x / 3x the error of a plain
bfloat16 PyTorch attention against a float32 truth).

The grid is not the Cartesian product: worlds 2 and 3 cover every pair of factor values
(a greedy pairwise design); worlds 2, 3, 4 and 8 also run every (causal, layout, backward)
combination, world 1 every (causal, layout) pair, with the other factors' values rotated.
"""
from __future__ import annotations

import itertools
import random

import pytest
import torch

from tests.dist.cases import attention
from tests.helpers import Case, assemble, reference_results, tolerance_failures

FACTORS = {
    "causal": [False, True],
    "layout": ["contiguous", "zigzag", "striped"],
    "heads": ["mha", "gqa", "mqa"],
    "head_dim": [32, 64, 128],
    "batch": [1, 2],
    "dtype": ["float32", "bfloat16"],
    "backward": ["burst", "kv", "auto"],
    "backend": ["reference", "cpu_flash"],
    "local_seq": [24, 48],
}


def pairwise(factors: dict[str, list], seed: int) -> list[dict]:
    """A deterministic greedy design in which every pair of factor values occurs in some row."""
    names = list(factors)
    rng = random.Random(seed)
    uncovered = {(a, va, b, vb) for a, b in itertools.combinations(names, 2)
                 for va in factors[a] for vb in factors[b]}

    def gain(row: dict) -> int:
        return sum((a, row[a], b, row[b]) in uncovered for a, b in itertools.combinations(names, 2)
                   if a in row and b in row)

    rows = []
    while uncovered:
        a, va, b, vb = sorted(uncovered, key=repr)[0]
        best, best_gain = None, -1
        for _ in range(30):
            row = {a: va, b: vb}
            for name in rng.sample(names, len(names)):
                if name not in row:
                    row[name] = max(factors[name], key=lambda val: (gain({**row, name: val}), rng.random()))
            if gain(row) > best_gain:
                best, best_gain = row, gain(row)
        rows.append(best)
        uncovered -= {(x, best[x], y, best[y]) for x, y in itertools.combinations(names, 2)}
    return rows


def core_paths(factors: dict[str, list], world: int, local_seq: int, keys: tuple[str, ...]) -> list[dict]:
    """Every combination of the ``keys`` factors; every other factor takes each of its values
    (cycled, then shuffled with a seed per world so the pairings differ between worlds)."""
    combos = list(itertools.product(*(factors[k] for k in keys)))
    rng = random.Random(world)
    columns = {}
    for name, vals in factors.items():
        column = [vals[i % len(vals)] for i in range(len(combos))]
        rng.shuffle(column)
        columns[name] = column
    return [{**{name: columns[name][i] for name in factors}, **dict(zip(keys, combo)), "local_seq": local_seq}
            for i, combo in enumerate(combos)]


def grid() -> list[Case]:
    rows = []
    for world in (2, 3):
        rows += [Case(world=world, seed=i, **r) for i, r in enumerate(pairwise(FACTORS, seed=world))]
    for world, local_seq in ((1, 64), (2, 32), (3, 16), (4, 32), (8, 16)):
        keys = ("causal", "layout") if world == 1 else ("causal", "layout", "backward")
        rows += [Case(world=world, seed=100 + i, **r)
                 for i, r in enumerate(core_paths(FACTORS, world, local_seq, keys))]
    return rows


GRID = grid()


def check_against_reference(pool, case: Case) -> None:
    results = pool.run(attention.forward_backward, case)
    ref = reference_results(case)
    got = dict(out=assemble(case, [r["out"] for r in results], 1),
               lse=assemble(case, [r["lse"] for r in results], 2),
               dq=assemble(case, [r["dq"] for r in results], 1),
               dk=assemble(case, [r["dk"] for r in results], 1),
               dv=assemble(case, [r["dv"] for r in results], 1))
    bad = tolerance_failures(case, got, ref)
    assert not bad, f"{case.id()}: (error, bound) {bad}"
    dtype = results[0]["out"].dtype
    assert all(r[x].dtype == dtype for r in results for x in ("out", "dq", "dk", "dv"))
    assert results[0]["lse"].dtype == torch.float32 and not results[0]["lse_requires_grad"]
    for rank, r in enumerate(results):
        assert r["out"].shape == (case.batch, case.local_seq, case.q_heads, case.head_dim)
        assert r["lse"].shape == (case.batch, case.q_heads, case.local_seq)


def test_grid_covers_every_factor_at_every_world_size():
    for world in (1, 2, 3, 4, 8):
        rows = [c for c in GRID if c.world == world]
        for name, values in FACTORS.items():
            if name != "local_seq":
                assert {getattr(c, name) for c in rows} >= set(values), (world, name)


@pytest.mark.parametrize("case", GRID, ids=Case.id)
def test_matches_reference(pools, case):
    check_against_reference(pools.get(case.world), case)


@pytest.mark.parametrize("case", [
    Case(world=2, local_seq=16, heads="mha", softmax_scale=0.3, causal=True, layout="striped", backward="burst"),
    Case(world=3, local_seq=2, heads="gqa", causal=True, layout="zigzag", backward="kv", backend="cpu_flash"),
    Case(world=3, local_seq=1, heads="mqa", causal=True, layout="striped", backward="burst"),
    Case(world=2, local_seq=1, heads="mha", causal=True, layout="contiguous", backward="kv", backend="cpu_flash"),
    Case(world=4, local_seq=8, heads="6/3", head_dim=8, causal=True, layout="striped", backward="kv",
         backend="cpu_flash"),
], ids=Case.id)
def test_edge_shapes(pools, case):
    """Explicit scale, one token per rank (striped STRICT blocks), local_seq 2 (zigzag chunks of 1)."""
    check_against_reference(pools.get(case.world), case)

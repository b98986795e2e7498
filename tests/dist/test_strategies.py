"""Every strategy of burstattn.attention against the float64 oracle, with its bytes and errors.

Each case: every rank shards the same full random q/k/v/grad_out (the strategy's layout: the
layout over the group, or USP's grid layout), runs forward + backward under comm_stats(), and
the parent reassembles out, dq, dk, dv and compares with exact_attention in float64
(the tolerance rule of tests/helpers.py: relative Frobenius error <= 1e-5 float32, flash-attn's rule
for bfloat16); every rank's measured bytes per
(phase, op) must equal the strategy's bytes_formula exactly. Plus: rsa's memory grows
quadratically and burst's linearly; bad inputs raise the same clear error on every rank.
"""
from __future__ import annotations

import itertools
import re

import pytest
import torch

from burstattn.strategies import STRATEGIES
from burstattn.strategies.heads import kv_repeats
from burstattn.strategies.tp import kv_index
from burstattn.strategies.usp import usp_positions
from tests.dist.cases import strategies as sc
from tests.helpers import DTYPES, Case, reference_results, tolerance_failures

LAYOUTS = ("contiguous", "zigzag", "striped")
HEADS = {1: ("mha", "gqa", "mqa"), 2: ("mha", "gqa", "mqa"), 3: ("6/3", "6/2", "6/1"), 4: ("mha", "gqa", "mqa")}


def grid() -> list[tuple[str, Case, int, str]]:
    """``(strategy, case, ulysses_degree, usp_build)`` rows: every (layout, causal) pair at every
    world size, heads and backend rotated; a bfloat16 case per strategy; USP's degree splits."""
    rows = []
    for strategy in ("rsa", "allgather", "ulysses", "tp"):
        for world in (1, 2, 3, 4):
            for i, (layout, causal) in enumerate(itertools.product(LAYOUTS, (False, True))):
                backend = "reference" if strategy == "rsa" or i % 2 else "cpu_flash"
                rows.append((strategy, Case(world=world, local_seq=8, batch=1 + i % 2, heads=HEADS[world][i % 3],
                                            head_dim=16, causal=causal, layout=layout, backend=backend,
                                            softmax_scale=0.3 if i == 5 else None, seed=i), 1, ""))
        rows.append((strategy, Case(world=4, local_seq=16, heads="gqa", head_dim=16, dtype="bfloat16", causal=True,
                                    layout="zigzag", backend="reference" if strategy == "rsa" else "cpu_flash"), 1, ""))
    for i, (layout, causal) in enumerate(itertools.product(LAYOUTS, (False, True))):
        rows.append(("usp", Case(world=4, local_seq=8, heads=HEADS[4][i % 3], head_dim=16, causal=causal,
                                 layout=layout, seed=i), 2, "groups"))
    for world, u, build, heads in ((4, 4, "degrees", "mqa"), (4, 1, "mesh", "gqa"), (4, 2, "mesh", "mqa"),
                                   (2, 2, "groups", "gqa"), (2, 1, "degrees", "mha"), (1, 1, "degrees", "gqa")):
        rows.append(("usp", Case(world=world, local_seq=8, heads=heads, head_dim=16, causal=True, layout="zigzag",
                                 backend="cpu_flash"), u, build))
    rows.append(("usp", Case(world=4, local_seq=16, heads="gqa", head_dim=16, dtype="bfloat16", causal=True,
                             layout="striped", backend="cpu_flash"), 2, "groups"))
    for strategy in ("rsa", "allgather", "ulysses", "tp", "usp"):  # float64 accumulates in float64
        rows.append((strategy, Case(world=2, local_seq=8, heads="gqa", head_dim=16, dtype="float64", causal=True,
                                    layout="striped"), 2 if strategy == "usp" else 1, "groups"))
    for strategy, layout in (("burst", "zigzag"), ("ring", "contiguous")):  # the registry's formulas for the core
        rows.append((strategy, Case(world=4, local_seq=8, heads="gqa", head_dim=16, causal=True, layout=layout), 1, ""))
    return rows


GRID = grid()


def row_id(row) -> str:
    strategy, case, u, build = row
    return f"{strategy}{f'-u{u}-{build}' if strategy == 'usp' else ''}-{case.id()}"


def expected_bytes(strategy: str, case: Case, u: int) -> dict:
    kw = dict(batch=case.batch, local_seq=case.local_seq, world_size=case.world, q_heads=case.q_heads,
              kv_heads=case.kv_heads, head_dim=case.head_dim, dtype=DTYPES[case.dtype])
    if strategy == "usp":  # the ring-level layout (and its bytes) follows the global layout
        kw.update(ulysses_degree=u, layout=case.layout, causal=case.causal)
    return {key: n for key, n in STRATEGIES[strategy].bytes_formula()(**kw)["ops"].items() if n}


@pytest.mark.parametrize("row", GRID, ids=row_id)
def test_exact_and_bytes(pools, row):
    strategy, case, u, build = row
    results = pools.get(case.world).run(sc.run_strategy, case, strategy, u, build)
    ref = reference_results(case)
    got = {}
    for name in ("out", "dq", "dk", "dv"):
        shape = list(results[0][name].shape)
        shape[1] = case.seq_len
        full = torch.full(shape, float("nan"), dtype=results[0][name].dtype)
        for r in results:
            assert r[name].dtype == DTYPES[case.dtype], (name, r[name].dtype)
            full.index_copy_(1, r["positions"], r[name])
        got[name] = full
    bad = tolerance_failures(case, got, ref)
    assert not bad, f"(error, bound) {bad}"
    assert results[0]["out"].shape == (case.batch, case.local_seq, case.q_heads, case.head_dim)
    want = expected_bytes(strategy, case, u)
    for rank, r in enumerate(results):
        assert r["sent"] == want, f"rank {rank}: measured {r['sent']} != formula {want}"


def test_grid_covers_every_layout_causality_gqa_and_usp_shape():
    for strategy in ("rsa", "allgather", "ulysses", "tp", "usp"):
        rows = [(c, u) for s, c, u, _ in GRID if s == strategy]
        assert {c.layout for c, _ in rows} == set(LAYOUTS) and {c.causal for c, _ in rows} == {False, True}
        assert {c.world for c, _ in rows} >= {1, 2, 4} and "bfloat16" in {c.dtype for c, _ in rows}
        assert {c.kv_heads < c.q_heads for c, _ in rows} == {False, True}  # GQA and MHA
    usp = {(c.world, u) for s, c, u, _ in GRID if s == "usp"}
    assert {(4, 2), (2, 2), (2, 1), (4, 4), (4, 1)} <= usp


def test_memory_rsa_quadratic_burst_linear(pools):
    """Peak bytes of forward + backward at local_seq 256 and 512 (2 ranks): doubling the sequence
    multiplies rsa's peak by ~4 (its n x N probabilities) and burst's by ~2."""
    pool = pools.get(2)
    ratio = {}
    for strategy in ("rsa", "burst"):
        small, large = (max(pool.run(sc.peak_memory, strategy, n)) for n in (256, 512))
        ratio[strategy] = large / small
    assert ratio["rsa"] >= 3.3, ratio
    assert ratio["burst"] <= 2.6, ratio


# ---- formulas and helpers, no process group ---------------------------------------------------
def test_formulas_relations():
    kw = dict(batch=2, local_seq=64, q_heads=8, head_dim=32, dtype=torch.bfloat16)
    f = {name: lambda world, spec=spec, **extra: spec.bytes_formula()(world_size=world, **{**kw, **extra})
         for name, spec in STRATEGIES.items()}
    # Ulysses: (P-1)/P * 4 B n Hq d elements per pass (MHA), 16-bit on the wire both ways
    assert f["ulysses"](4, kv_heads=8)["forward"] - f["ulysses"](4, kv_heads=8)["ops"][("forward", "meta")] \
        == 3 * (2 * 64 * 4 * 8 * 32 * 2) // 4 == f["ulysses"](4, kv_heads=8)["backward"]
    # rsa moves K then V: its forward equals the K/V ring's
    assert f["rsa"](4, kv_heads=2)["forward"] == f["ring"](4, kv_heads=2)["forward"]
    # all-gather CP sends the same K/V as a ring forward; tp gathers q too
    assert f["allgather"](4, kv_heads=2)["ops"][("forward", "kv")] == f["ring"](4, kv_heads=2)["ops"][("forward", "kv")]
    assert f["tp"](4, kv_heads=2)["forward"] > f["allgather"](4, kv_heads=2)["forward"]
    # usp with ulysses_degree 1 is the burst ring (its input is checked twice, on the group and
    # on the ring); with ring_degree 1 it is Ulysses
    nonzero = lambda ops, drop=(): {key: n for key, n in ops.items() if n and key not in drop}  # noqa: E731
    meta = [("forward", "meta")]
    assert nonzero(f["usp"](4, kv_heads=2, ulysses_degree=1)["ops"], meta) == nonzero(f["burst"](4, kv_heads=2)["ops"], meta)
    assert nonzero(f["usp"](4, kv_heads=2, ulysses_degree=4)["ops"]) == nonzero(f["ulysses"](4, kv_heads=2)["ops"])
    assert all(v == 0 for name in STRATEGIES for v in f[name](1, kv_heads=2, **(
        {"ulysses_degree": 1} if name == "usp" else {}))["ops"].values())


def test_head_helpers():
    assert [kv_repeats(h, 4) for h in (1, 2, 3, 4, 8)] == [4, 2, 4, 1, 1]
    assert kv_index(0, 4, 2) == [0, 1]  # two kv heads, GQA ratio 2 locally
    assert kv_index(2, 2, 4) == [0]  # both query heads read kv head 0
    assert kv_index(3, 3, 2) == [1, 2, 2]  # uneven: one kv head per query head
    # one meaning per layout: (ring 0, ulysses 1) is group rank 1 of 4, zigzag chunks 1 and 6 of 8
    assert usp_positions(16, ring_rank=0, ring_degree=2, ulysses_rank=1, ulysses_degree=2,
                         layout="zigzag").tolist() == [2, 3, 12, 13]
    seen = torch.cat([usp_positions(24, ring_rank=r, ring_degree=2, ulysses_rank=u, ulysses_degree=3,
                                    layout="striped") for r in range(2) for u in range(3)])
    assert sorted(seen.tolist()) == list(range(24))


# ---- bad inputs -------------------------------------------------------------------------------
# scenario -> (exception type, words every rank's message must contain); see cases/strategies._bad_call
BAD = {
    "unknown_strategy": ("ValueError", ["strategy", "nope"]),
    "option": ("ValueError", ["rsa", "backward"]),
    "usp_option_typo": ("ValueError", ["usp", "ulysses", "ulysses_degree"]),
    "layout_unsupported": ("ValueError", ["rsa", "layout", "Partition", "contiguous", "zigzag", "striped"]),
    "layout_unknown": ("ValueError", ["tp", "layout", "diagonal"]),
    "rsa_backend": ("ValueError", ["rsa", "backend", "cpu_flash"]),
    "ulysses_heads": ("ValueError", ["ulysses", "q_heads", "3", "divisible"]),
    "tp_heads": ("ValueError", ["tp", "q_heads", "3", "divisible"]),
    "usp_heads": ("ValueError", ["usp", "q_heads", "ulysses_degree"]),
    "usp_degrees": ("ValueError", ["usp", "ulysses_degree", "ring_degree", "group size"]),
    "usp_degrees@1": ("ValueError", ["usp", "ring_degree"]),
    "usp_missing": ("ValueError", ["usp", "ulysses_degree", "mesh"]),
    "usp_both": ("ValueError", ["usp", "mesh", "ulysses_group"]),
    "allgather_ndim@1": ("ValueError", ["allgather", "q"]),
    "ulysses_kvheads@1": ("ValueError", ["ulysses", "kv_heads"]),
}


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("scenario", sorted(BAD))
def test_bad_input_every_rank(pools, world, scenario):
    if world == 1 and ("@" in scenario or scenario.endswith("_heads")):
        pytest.skip("needs a second rank (one rank, or any head count divides by 1)")
    kind, words = BAD[scenario]
    results = pools.get(world).run(sc.bad_input, scenario)
    assert [k for k, _ in results] == [kind] * world, results
    for rank, (_, msg) in enumerate(results):
        for word in words:
            assert re.search(rf"(?<!\w){re.escape(word)}(?!\w)", msg), f"rank {rank} lacks {word!r}: {msg!r}"

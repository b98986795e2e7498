"""Sequence-parallel recurrences (burstattn.recurrent) against one process: Gated DeltaNet, KDA, linear
attention with decay, Mamba2 SSD, lightning attention and the causal short convolution; output, final
state and every gradient, float64 and float32, every layout and packed documents, at worlds 2, 3, 4;
both ways of passing the state (the all-gather and the log-depth scan, also at world 8), an initial
state; bytes and rounds equal to the formulas, independent of the number of packed documents; bad or
disagreeing inputs raise on every rank."""
from __future__ import annotations

import itertools

import pytest

from burstattn.recurrent import conv_halo_bytes, state_passing_bytes, state_passing_steps
from burstattn.recurrent.segments import segment_plan
from burstattn.sim.recurrent import StateShape, passing_memory
from tests.dist.cases import hybrid
from tests.dist.cases.hybrid import RecCase
from tests.helpers import EXACT

KINDS = ("gdn", "kda", "linear", "ssd", "lightning", "conv")
LAYOUTS = ("contiguous", "zigzag", "striped", "partition")


def rows(world: int) -> list:
    out = []
    for i, (kind, layout) in enumerate(itertools.product(KINDS, LAYOUTS)):
        dtype = ("float64", "float32")[i % 2]
        out.append(RecCase(kind, layout, dtype, world, seed=i))
        # packed documents: every kind, layouts rotating, the other dtype
        if layout == LAYOUTS[i % len(LAYOUTS)] or i % len(LAYOUTS) == (KINDS.index(kind) + 1) % len(LAYOUTS):
            out.append(RecCase(kind, layout, ("float32", "float64")[i % 2], world, packed=True, seed=100 + i))
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_recurrences_every_layout(pools, world):
    grid = rows(world)
    bad = [("bad", RecCase(kind, "zigzag", "float64", world)) for kind in ("gdn", "linear", "conv", "scheme",
                                                                          "initial")]
    meter = [("bytes", RecCase("gdn", layout, "float32", world)) for layout in ("contiguous", "zigzag", "striped")]
    results = pools.get(world).run(hybrid.recurrence_grid, grid + bad + meter)
    failures = []
    for case, res in zip(grid, results[0]):
        if isinstance(res, str) or max(res.values()) > EXACT[case.dtype]:
            failures.append(f"{case}: {res}")
    assert not failures, "\n".join(failures)
    assert {c.packed for c in grid} == {True, False}
    for i, (_, case) in enumerate(bad):  # every rank refuses, naming the argument
        for rank, res in enumerate(results):
            msg = res[len(grid) + i]
            assert msg.startswith("ValueError"), (case.kind, rank, msg)
            want = {"gdn": "chunk_size", "linear": "cu_seqlens", "conv": "channels", "scheme": "scheme",
                    "initial": "initial_state"}[case.kind]
            assert want in msg, (case.kind, rank, msg)
    for i, (_, case) in enumerate(meter):  # the meter equals the formulas, on every rank
        N = case.local_seq * world
        state = state_passing_bytes(N, world, case.layout, batch=2, heads=2, dk=4, dv=3, matrix=True, element_size=8)
        halo = conv_halo_bytes(N, world, case.layout, batch=2, channels=5, element_size=8)
        want = {"forward/state": state["forward"], "backward/dstate": state["backward"],
                "forward/halo": halo["forward"], "backward/dhalo": halo["backward"],
                "forward/dstate": 0, "forward/dhalo": 0, "backward/state": 0, "backward/halo": 0}
        assert state["forward"] > 0 and halo["forward"] > 0
        for rank, res in enumerate(results):
            assert res[len(grid) + len(bad) + i] == want, (case.layout, rank, res[len(grid) + len(bad) + i], want)


def scan_rows(world: int) -> list:
    """The scan: every recurrence x layout in float64, documents and an initial state rotating."""
    out = []
    for i, (kind, layout) in enumerate(itertools.product(KINDS[:-1], LAYOUTS)):
        out.append(RecCase(kind, layout, "float64", world, scheme="scan", packed=i % 3 == 1, initial=i % 2 == 0,
                           seed=200 + i))
    # the all-gather with an initial state (the rows above use the scheme "auto": the all-gather here)
    out += [RecCase(kind, "zigzag", "float64", world, initial=True, packed=kind == "gdn", seed=300 + j)
            for j, kind in enumerate(KINDS[:-1])]
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_scan_and_initial_state_every_layout(pools, world):
    grid = scan_rows(world)
    results = pools.get(world).run(hybrid.recurrence_grid, grid)
    failures = [f"{case}: {res}" for case, res in zip(grid, results[0])
                if isinstance(res, str) or max(res.values()) > EXACT[case.dtype]]
    assert not failures, "\n".join(failures)
    assert {(c.scheme, c.initial) for c in grid} >= {("scan", True), ("scan", False), ("auto", True)}


def _state_want(case: RecCase, rank: int) -> dict:
    N = case.local_seq * case.world
    kw = dict(cu_seqlens=hybrid.cu_of(case), output_final_state=case.initial, scheme=case.scheme,
              initial_state_grad=case.initial, rank=rank)
    b = state_passing_bytes(N, case.world, case.layout, batch=2, heads=2, dk=4, dv=3, matrix=True, element_size=8,
                            **kw)
    st = state_passing_steps(N, case.world, case.layout, **kw)
    return {"forward/state": [b["forward"], st["forward"]], "backward/dstate": [b["backward"], st["backward"]]}


def test_state_bytes_do_not_grow_with_packed_documents(pools):
    """64 packed documents over 4 ranks (zigzag): only the segments that touch a rank boundary travel,
    so the bytes equal the unpacked case's; metered equal to the formulas on every rank, both schemes."""
    world, n = 4, 128
    rows = [("state", RecCase("gdn", layout, "float32", world, local_seq=n, docs=docs, scheme=scheme,
                              initial=initial, seed=1))
            for layout in ("zigzag", "contiguous") for docs in (0, 64) for scheme in ("allgather", "scan")
            for initial in (False, True)]
    cu = hybrid.cu_of(rows[4][1])
    assert len(cu) == 65 and not set(cu[1:-1]) & set(range(0, n * world, n // 2))  # no start on a chunk edge
    plan = segment_plan(n * world, world, "zigzag", cu)
    assert plan.max_segments > 16 and max(len(plan.sent(r)) for r in range(world)) == 2
    results = pools.get(world).run(hybrid.recurrence_grid, rows)
    got = {}
    for i, (_, case) in enumerate(rows):
        for rank in range(world):
            assert results[rank][i] == _state_want(case, rank), (case, rank, results[rank][i])
        got[case.layout, case.docs, case.scheme, case.initial] = max(results[r][i]["forward/state"][0]
                                                                     for r in range(world))
    for layout in ("zigzag", "contiguous"):
        for initial in (False, True):
            assert got[layout, 64, "allgather", initial] == got[layout, 0, "allgather", initial] > 0
            assert got[layout, 64, "scan", initial] <= got[layout, 0, "scan", initial]


def test_scan_at_world_8(pools):
    """The scan at 8 ranks (one thread each): against the oracle and the all-gather, forward and
    backward, with packed documents and an initial state; bytes and rounds as the formulas."""
    world = 8
    exact = [RecCase("gdn", "zigzag", "float64", world, local_seq=4, scheme="scan", packed=True, initial=True,
                     seed=400),
             RecCase("linear", "contiguous", "float64", world, local_seq=4, scheme="scan", initial=True, seed=401)]
    gap = ("gap", RecCase("kda", "zigzag", "float64", world, local_seq=4, initial=True, seed=402))
    meter = ("state", RecCase("gdn", "zigzag", "float32", world, local_seq=4, scheme="scan", initial=True, seed=403))
    kept = ("kept", RecCase("gdn", "zigzag", "float32", world, seed=404))
    results = pools.get(world).run(hybrid.recurrence_grid, exact + [gap, meter, kept])
    for case, res in zip(exact, results[0]):
        assert not isinstance(res, str) and max(res.values()) <= EXACT["float64"], (case, res)
    for rank in range(world):
        res = results[rank][len(exact)]
        assert not isinstance(res, str) and max(res.values()) <= EXACT["float64"], (rank, res)
        assert results[rank][-2] == _state_want(meter[1], rank), (rank, results[rank][-2])
    # what a rank keeps for the backward, the worst rank's, against the simulator's term: the all-gather's
    # 2P maps and the fold's states exactly; the scan's O(log P) within a map (a local composition may
    # share its source's storage)
    shape = StateShape(1, 2, 8, 4)
    measured = {s: max(results[r][-1][s] for r in range(world)) for s in ("allgather", "scan")}
    assert measured["allgather"] == passing_memory(shape, world, "allgather")
    assert measured["scan"] <= passing_memory(shape, world, "scan") <= measured["scan"] + shape.full
    assert measured["scan"] < measured["allgather"] / 2
    assert state_passing_steps(32, world, "zigzag", scheme="scan")["forward"] == 5  # ceil(log2 15) + the shift


@pytest.mark.parametrize("world", [2, 3])
def test_every_bad_input_of_the_ops_raises_on_every_rank(pools, world):
    """A bad input on the last rank only (sp_ssd's heads not a multiple of the groups, a wrong dt / A / D /
    slope shape, a missing or non-tensor input, an integer tensor, kernel='fla' on CPU): every rank raises
    ValueError, its message naming the bad rank's problem (nothing raised outside the agreement, nothing hangs)."""
    whats = list(hybrid.BAD_FAMILY)
    results = pools.get(world).run(hybrid.run_bad_family, whats)
    for what, needle in hybrid.BAD_FAMILY.items():
        for rank, res in enumerate(results):
            assert res[what].startswith("ValueError") and needle in res[what], (what, rank, res[what])

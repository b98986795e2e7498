"""Sequence-parallel recurrences (burstattn.recurrent) against one process: Gated DeltaNet, KDA, linear
attention with decay, Mamba2 SSD, lightning attention and the causal short convolution; output, final
state and every gradient, float64 and float32, every layout and packed documents, at worlds 2, 3, 4;
bad or disagreeing inputs raise on every rank."""
from __future__ import annotations

import itertools

import pytest

from burstattn.recurrent import conv_halo_bytes, state_passing_bytes
from tests.dist import recurrent_cases
from tests.dist.recurrent_cases import RecCase
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
    bad = [("bad", RecCase(kind, "zigzag", "float64", world)) for kind in ("gdn", "linear", "conv")]
    meter = [("bytes", RecCase("gdn", layout, "float32", world)) for layout in ("contiguous", "zigzag", "striped")]
    results = pools.get(world).run(recurrent_cases.run_grid, grid + bad + meter)
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
            want = {"gdn": "chunk_size", "linear": "cu_seqlens", "conv": "channels"}[case.kind]
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

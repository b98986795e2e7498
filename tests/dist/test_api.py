"""The rest of the public surface in real process groups: layouts round trip, dtypes, the
module, the byte meter against the formulas, the overlap seen in the trace, and a property
test over random valid shapes."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from burstattn.engine.bytes import ring_bytes
from tests.dist.cases import attention
from tests.dist.test_attention import check_against_reference
from tests.helpers import DTYPES, Case


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize("dim", [1, 0, -1])
def test_shard_gather_round_trip_and_gradient(pools, world, layout, dim):
    results = pools.get(world).run(attention.shard_gather, layout, dim)
    full, weights = results[0]["full"], results[0]["weights"]
    seq_dim = dim % full.dim()
    for rank, r in enumerate(results):
        assert torch.equal(r["positions"], r["expected_positions"])
        assert torch.equal(r["local"], full.index_select(seq_dim, r["positions"]))
        assert torch.equal(r["gathered"], full), f"rank {rank}: gather(shard(x)) != x"
        # gather's adjoint: the local grad sums what every rank's loss hands back
        expected = sum(weights).index_select(seq_dim, r["positions"])
        torch.testing.assert_close(r["grad"], expected, rtol=1e-6, atol=1e-6)
    positions = torch.cat([r["positions"] for r in results])
    assert torch.equal(positions.sort().values, torch.arange(full.shape[seq_dim]))


@pytest.mark.parametrize("dtype,backend", [("float32", "auto"), ("bfloat16", "auto"), ("float16", "reference"),
                                           ("float64", "auto"), ("float32", "cpu_flash"), ("bfloat16", "reference")])
def test_return_lse_and_output_dtype(pools, dtype, backend):
    for res in pools.get(2).run(attention.dtypes_out, dtype, backend):
        out_dtype, out_shape, lse_dtype, lse_shape, lse_grad, plain_is_tensor, same = res
        assert out_dtype == DTYPES[dtype] and out_shape == (2, 8, 8, 16)
        lse_expected = torch.float64 if dtype == "float64" else torch.float32  # float64 accumulates in float64
        assert lse_dtype == lse_expected and lse_shape == (2, 8, 8) and not lse_grad
        assert plain_is_tensor and same


@pytest.mark.parametrize("case", [
    Case(world=2, heads="gqa", causal=True, layout="zigzag", backward="burst", softmax_scale=0.2),
    Case(world=3, heads="mha", causal=True, layout="striped", backward="kv", backend="cpu_flash"),
], ids=Case.id)
def test_module_equals_function(pools, case):
    for r in pools.get(case.world).run(attention.module_vs_func, case):
        for a, b in zip(r["func"], r["module"]):
            assert torch.equal(a, b)


BYTE_CASES = [
    Case(world=2, heads="mha", dtype="float32", backward="burst"),
    Case(world=2, heads="mha", dtype="float32", backward="kv", causal=True),
    Case(world=3, heads="mha", dtype="bfloat16", backward="kv", layout="striped", batch=2),
    Case(world=3, heads="gqa", dtype="bfloat16", backward="burst", causal=True),
    Case(world=3, heads="gqa", dtype="bfloat16", backward="kv", causal=True, layout="contiguous"),
    Case(world=4, heads="mqa", dtype="float32", backward="burst", head_dim=16),
    Case(world=2, heads="mha", dtype="bfloat16", backward="auto"),
    Case(world=3, heads="gqa", dtype="float32", backward="auto", causal=True),
    Case(world=4, heads="mha", dtype="float32", backward="auto", head_dim=8),
    Case(world=1, heads="mha", dtype="float32", backward="burst"),
]


@pytest.mark.parametrize("case", BYTE_CASES, ids=Case.id)
def test_comm_bytes_match_formula(pools, case):
    kw = dict(batch=case.batch, local_seq=case.local_seq, world_size=case.world, q_heads=case.q_heads,
              kv_heads=case.kv_heads, head_dim=case.head_dim, dtype=DTYPES[case.dtype])
    by_mode = {mode: ring_bytes(backward=mode, **kw) for mode in ("burst", "kv")}
    mode = case.backward
    if mode == "auto":
        mode = min(("burst", "kv"), key=lambda m: (by_mode[m]["backward"], m != "burst"))
    expected = by_mode[mode]["ops"]
    for rank, stats in enumerate(pools.get(case.world).run(attention.comm_bytes, case)):
        measured = {(phase, op): row["sent"] for phase, ops in stats.items() for op, row in ops.items()}
        for key in set(expected) | set(measured):
            assert measured.get(key, 0) == expected.get(key, 0), (
                f"rank {rank} {key}: sent {measured.get(key, 0)} bytes, formula {expected.get(key, 0)} "
                f"(measured {measured}, backward={mode})")
        received = {(phase, op): row["recv"] for phase, ops in stats.items() for op, row in ops.items()}
        assert received == measured, f"rank {rank}: a ring receives what it sends"


def test_auto_prefers_burst_for_mha_and_kv_for_gqa():
    kw = dict(batch=1, local_seq=16, world_size=4, head_dim=64, dtype=torch.bfloat16)
    mha = {m: ring_bytes(backward=m, q_heads=8, kv_heads=8, **kw)["backward"] for m in ("burst", "kv")}
    gqa = {m: ring_bytes(backward=m, q_heads=8, kv_heads=2, **kw)["backward"] for m in ("burst", "kv")}
    assert mha["burst"] < mha["kv"] and gqa["kv"] < gqa["burst"]


@pytest.mark.parametrize("case", [
    Case(world=3, heads="mha", backward="burst", causal=True, layout="zigzag", local_seq=32),
    Case(world=4, heads="gqa", backward="kv", causal=False, layout="striped", local_seq=32),
], ids=Case.id)
def test_transfer_posted_before_compute(pools, case):
    """Double buffering: the transfer that brings step t+1's block is posted before step t computes."""
    travelling = {"forward": "kv", "backward": "kv" if case.backward == "kv" else "q"}
    for rank, events in enumerate(pools.get(case.world).run(attention.traced, case)):
        for phase, op in travelling.items():
            posts = sorted((e for e in events if e["name"] == "post" and e["phase"] == phase and e["op"] == op),
                           key=lambda e: e["t0_ns"])
            computes = {e["step"]: e for e in events if e["name"] == "compute" and e["phase"] == phase}
            assert len(posts) == case.world - 1, (rank, phase, posts)
            assert sorted(computes) == list(range(case.world)), (rank, phase, sorted(computes))
            for t in range(case.world - 1):
                assert posts[t]["t0_ns"] < computes[t]["t0_ns"], (
                    f"rank {rank} {phase}: transfer for step {t + 1} posted at {posts[t]['t0_ns']}, "
                    f"after step {t}'s compute started at {computes[t]['t0_ns']}")
            for e in events:
                assert e["rank"] == rank and e["t1_ns"] >= e["t0_ns"]


@st.composite
def valid_cases(draw):
    kv_heads = draw(st.integers(1, 2))
    return Case(world=draw(st.sampled_from([2, 3])), local_seq=2 * draw(st.integers(1, 10)),
                batch=draw(st.integers(1, 2)), heads=f"{kv_heads * draw(st.integers(1, 3))}/{kv_heads}",
                head_dim=draw(st.sampled_from([8, 16, 24, 40])), causal=draw(st.booleans()),
                layout=draw(st.sampled_from(["contiguous", "zigzag", "striped"])),
                backward=draw(st.sampled_from(["burst", "kv", "auto"])),
                backend=draw(st.sampled_from(["reference", "cpu_flash"])),
                softmax_scale=draw(st.one_of(st.none(), st.floats(0.05, 2.0))),
                seed=draw(st.integers(0, 2**31 - 1)))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=valid_cases())
def test_property_random_valid_shapes(pools, case):
    check_against_reference(pools.get(case.world), case)

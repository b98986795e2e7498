"""DistFlashAttn's load-balanced causal schedule: exact against the float64 oracle, bytes equal
to the plan's formula on every rank, bad options rejected on every rank."""
from __future__ import annotations

import pytest

from burstattn.engine.bytes import distflash_bytes
from tests.dist.cases import attention
from tests.helpers import DTYPES, Case, assemble, reference_results, tolerance_failures

CASES = [
    Case(world=2, local_seq=16, heads="mha", head_dim=32, causal=True, layout="contiguous", backend="cpu_flash"),
    Case(world=3, local_seq=8, heads="gqa", head_dim=32, causal=True, layout="contiguous", backend="reference",
         batch=2),
    Case(world=3, local_seq=5, heads="mqa", head_dim=64, causal=True, layout="contiguous", backend="cpu_flash"),
    Case(world=4, local_seq=16, heads="gqa", head_dim=64, causal=True, layout="contiguous", backend="cpu_flash",
         dtype="bfloat16"),
    Case(world=4, local_seq=8, heads="mha", head_dim=32, causal=True, layout="contiguous", backend="reference",
         softmax_scale=0.2),
    Case(world=8, local_seq=8, heads="gqa", head_dim=32, causal=True, layout="contiguous", backend="cpu_flash"),
    Case(world=1, local_seq=16, heads="mha", head_dim=32, causal=True, layout="contiguous", backend="cpu_flash"),
]


@pytest.mark.parametrize("case", CASES, ids=Case.id)
def test_distflash_matches_reference_and_formula(pools, case):
    results = pools.get(case.world).run(attention.distflash, case)
    ref = reference_results(case)
    got = {name: assemble(case, [r[name] for r in results], 2 if name == "lse" else 1)
           for name in ("out", "lse", "dq", "dk", "dv")}
    bad = tolerance_failures(case, got, ref)
    assert not bad, bad
    for rank, r in enumerate(results):
        want = distflash_bytes(rank=rank, batch=case.batch, local_seq=case.local_seq, world_size=case.world,
                               q_heads=case.q_heads, kv_heads=case.kv_heads, head_dim=case.head_dim,
                               dtype=DTYPES[case.dtype])["ops"]
        if case.world == 1:
            want = {}
        assert {key: v for key, v in r["sent"].items() if v} == {key: v for key, v in want.items() if v}, rank


@pytest.mark.parametrize("kwargs,needle", [
    (dict(causal=False, layout="contiguous"), "causal=True"),
    (dict(causal=True, layout="zigzag"), "layout='contiguous'"),
    (dict(causal=True, layout="contiguous", backward="kv"), "backward='auto'"),
])
def test_distflash_bad_options_raise_on_every_rank(pools, kwargs, needle):
    for kind, message in pools.get(2).run(attention.distflash_bad, kwargs):
        assert kind == "ValueError" and "distflash" in message and needle in message, message


DOUBLE = [
    (Case(world=4, local_seq=16, heads="mha", head_dim=32, causal=True, layout="zigzag", backend="cpu_flash",
          backward="burst"), 2),
    (Case(world=4, local_seq=8, heads="gqa", head_dim=32, causal=False, layout="contiguous", backend="reference",
          backward="kv"), 2),
    (Case(world=2, local_seq=16, heads="mha", head_dim=32, causal=True, layout="striped", backend="cpu_flash",
          backward="burst"), 1),
    (Case(world=2, local_seq=16, heads="gqa", head_dim=32, causal=True, layout="zigzag", backend="cpu_flash",
          backward="kv"), 2),
    (Case(world=3, local_seq=8, heads="mqa", head_dim=32, causal=True, layout="zigzag", backend="reference",
          backward="burst"), 3),
    (Case(world=8, local_seq=8, heads="mha", head_dim=32, causal=True, layout="zigzag", backend="cpu_flash",
          backward="kv", dtype="bfloat16"), 4),
    (Case(world=8, local_seq=8, heads="gqa", head_dim=16, causal=False, layout="zigzag", backend="cpu_flash",
          backward="burst"), 2),
]


@pytest.mark.parametrize("case,ranks_per_node", DOUBLE, ids=lambda x: x.id() if isinstance(x, Case) else f"R{x}")
def test_double_ring_matches_reference_and_formula(pools, case, ranks_per_node):
    from burstattn.engine.bytes import double_bytes

    results = pools.get(case.world).run(attention.double_ring, case, ranks_per_node)
    ref = reference_results(case)
    got = {name: assemble(case, [r[name] for r in results], 2 if name == "lse" else 1)
           for name in ("out", "lse", "dq", "dk", "dv")}
    bad = tolerance_failures(case, got, ref)
    assert not bad, bad
    want = double_bytes(batch=case.batch, local_seq=case.local_seq, world_size=case.world, ranks_per_node=ranks_per_node,
                        q_heads=case.q_heads, kv_heads=case.kv_heads, head_dim=case.head_dim,
                        dtype=DTYPES[case.dtype], backward=case.backward)["ops"]
    for rank, r in enumerate(results):
        assert {key: v for key, v in r["sent"].items() if v} == {key: v for key, v in want.items() if v}, rank

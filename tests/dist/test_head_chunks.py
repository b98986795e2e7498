"""Attention chunked over heads (burstattn.models.head_chunks) against the float64 oracle.

Every row runs forward + backward through ``head_chunked_attention`` on real gloo ranks (worlds 2
and 3, several strategies, GQA groups kept whole) and the parent reassembles out, dq, dk, dv and
compares with the unsharded float64 attention (tests/helpers.py's rule: float32 within 1e-5).
The bytes sent equal the plain call's (the strategy's formula) per (phase, op), but for the input
check, which each group's call makes once; the messages are ``chunks`` times more. The call's own
peak memory falls with the groups (measured, float32).
"""
from __future__ import annotations

import pytest
import torch

from burstattn.models.head_chunks import head_chunks_problem, head_slices
from tests.dist.cases import strategies as hc
from tests.dist.test_strategies import expected_bytes
from tests.helpers import DTYPES, Case, full_inputs, reference_results, tolerance_failures

ROWS = {
    2: [(Case(world=2, local_seq=8, heads="8/4", head_dim=16, causal=True, layout="zigzag"), "burst", 2, 1, ()),
        (Case(world=2, local_seq=8, heads="8/4", head_dim=16, causal=True, layout="contiguous"), "ring", 4, 1, ()),
        (Case(world=2, local_seq=8, heads="8/4", head_dim=16, causal=True, layout="zigzag", backend="cpu_flash"),
         "ulysses", 2, 1, ()),
        (Case(world=2, local_seq=8, heads="8/2", head_dim=16, causal=False, layout="striped"), "allgather", 2, 1, ()),
        (Case(world=2, local_seq=8, heads="8/4", head_dim=16, causal=True, layout="zigzag"), "tp", 2, 1, ()),
        (Case(world=2, local_seq=8, heads="8/4", head_dim=16, causal=True, layout="zigzag"), "usp", 2, 2, ()),
        (Case(world=2, local_seq=8, heads="8/2", head_dim=16, causal=True, layout="zigzag"), "burst", 2, 1,
         ("alibi", "sinks")),
        # more groups than kv heads (MQA): each group resends the one kv head
        (Case(world=2, local_seq=8, heads="4/1", head_dim=16, causal=True, layout="zigzag"), "burst", 4, 1, ()),
        (Case(world=2, local_seq=8, heads="8/2", head_dim=16, causal=True, layout="striped"), "ring", 4, 1, ())],
    3: [(Case(world=3, local_seq=8, heads="6/3", head_dim=16, causal=True, layout="zigzag"), "burst", 3, 1, ()),
        (Case(world=3, local_seq=8, heads="12/6", head_dim=16, causal=True, layout="striped", backend="cpu_flash"),
         "ulysses", 2, 1, ()),
        (Case(world=3, local_seq=8, heads="6/3", head_dim=16, causal=True, layout="contiguous"), "allgather", 3, 1,
         ()),
        (Case(world=3, local_seq=8, heads="6/3", head_dim=16, causal=False, layout="zigzag"), "ring", 3, 1, ())],
}


def reference(case: Case, extras: tuple) -> dict:
    if not extras:
        return reference_results(case)
    # alibi slopes and sinks: the plain single-process call of the same options, in float64
    import burstattn

    q, k, v, dout = (x.double() for x in full_inputs(case))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    gen = torch.Generator().manual_seed(7)
    slopes = torch.rand(case.q_heads, generator=gen, dtype=torch.float32).double()
    sinks = torch.randn(case.q_heads, generator=gen, dtype=torch.float32).double().requires_grad_()
    out = burstattn.burst_attn_func(q, k, v, causal=case.causal, layout="contiguous", alibi_slopes=slopes,
                                    sinks=sinks)
    out.backward(dout)
    return dict(out=out.detach(), dq=q.grad, dk=k.grad, dv=v.grad, dsinks=sinks.grad)


@pytest.mark.parametrize("world", sorted(ROWS))
def test_exact_bytes_and_messages(pools, world):
    rows = ROWS[world]
    results = pools.get(world).run(hc.run_chunked, rows)
    for i, (case, strategy, chunks, u, extras) in enumerate(rows):
        per_rank = [r[i] for r in results]
        got = {}
        for name in ("out", "dq", "dk", "dv"):
            shape = list(per_rank[0][name].shape)
            shape[1] = case.seq_len
            full = torch.full(shape, float("nan"), dtype=per_rank[0][name].dtype)
            for r in per_rank:
                assert r[name].dtype == DTYPES[case.dtype]
                full.index_copy_(1, r["positions"], r[name])
            got[name] = full
        ref = reference(case, extras)
        bad = tolerance_failures(case, got, ref)
        assert not bad, f"{strategy} chunks={chunks} {case.id()}: (error, bound) {bad}"
        if extras:
            dsinks = sum(r["dsinks"].double() for r in per_rank)  # each rank's share of the sinks' gradient
            assert torch.allclose(dsinks, ref["dsinks"], rtol=1e-5, atol=1e-6), (dsinks, ref["dsinks"])
            continue
        if chunks > case.kv_heads:  # a kv head shared by chunks / Hkv groups travels once per group
            continue
        want = expected_bytes(strategy, case, u)
        for rank, r in enumerate(per_rank):
            sent = {(p, op): row["sent"] for p, ops in r["stats"].items() for op, row in ops.items()}
            meta = {key for key in sent if key[1] == "meta"}
            assert {key: n for key, n in sent.items() if key not in meta and n} == \
                {key: n for key, n in want.items() if key not in meta}, (strategy, rank)
            for key in meta:  # one input check per group's call
                assert sent[key] == chunks * want.get(key, sent[key] // chunks), (strategy, key)


def test_messages_grow_with_the_groups(pools):
    """The same bytes in ``chunks`` times more messages (burst, world 2)."""
    case = Case(world=2, local_seq=8, heads="8/4", head_dim=16, causal=True, layout="zigzag")
    one, four = pools.get(2).run(hc.run_chunked, [(case, "burst", 1, 1, ()), (case, "burst", 4, 1, ())])[0]
    for phase, ops in one["stats"].items():
        for op, row in ops.items():
            if op != "meta" and row["sent"]:
                assert four["stats"][phase][op]["sent"] == row["sent"]
                assert four["stats"][phase][op]["msgs"] == 4 * row["msgs"], (phase, op)


def test_call_peak_falls_with_the_groups(pools):
    """The attention call's own peak (inputs excluded) per head group, float32, world 2, causal zigzag,
    n = 512 per rank, 8/8 heads, d = 32: what scales with the heads in flight falls with the groups;
    what stays whole (the output, dQ, dK, dV: 4 query shards) bounds it from below."""
    pool = pools.get(2)
    shard = 512 * 8 * 32 * 4
    peaks = {}
    for strategy in ("burst", "ulysses", "allgather"):
        for chunks in (1, 4):
            peaks[strategy, chunks] = max(pool.run(hc.call_peak, strategy, chunks, 512, (8, 8), 32))
        assert peaks[strategy, 4] < 0.8 * peaks[strategy, 1], peaks
        assert peaks[strategy, 4] >= 3.5 * shard, peaks


def test_problems_and_slices():
    assert head_chunks_problem(2, 8, 4) is None
    assert "divide the kv heads" in head_chunks_problem(3, 6, 2)
    assert head_chunks_problem(4, 4, 1) is None and head_chunks_problem(4, 8, 2) is None
    assert head_slices(4, 1, 4)[3] == (slice(3, 4), slice(0, 1))
    assert [kv for _, kv in head_slices(8, 2, 4)] == [slice(0, 1), slice(0, 1), slice(1, 2), slice(1, 2)]
    assert "positive int" in head_chunks_problem(0, 8, 4)
    assert head_slices(8, 2, 2) == [(slice(0, 4), slice(0, 1)), (slice(4, 8), slice(1, 2))]

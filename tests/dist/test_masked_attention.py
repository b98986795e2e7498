"""Masks (windows, packed documents, mask_mod) on the burst engine: exact against the float64 dense
oracle with the same mask, forward and gradients, at world sizes 1-4; rows that see nothing give
0 / -inf and no NaN; bytes equal the sparse plan's formula on every rank; bad masks raise on every
rank."""
from __future__ import annotations

import pytest
import torch

from tests.dist.cases import masks
from tests.helpers import EXACT, Case, rel_err, tolerance_failures

KINDS = ["window", "window_causal", "window_zero", "window_left_only", "window_wide", "docs", "one_doc",
         "doc_ids", "docs_window", "local_global", "blind_rows", "strided"]


def _cases():
    out = []
    for i, kind in enumerate(KINDS):
        for world in (1, 2, 4):
            for causal in (False, True):
                heads = "gqa" if (i + world) % 2 else "mha"
                backend = "cpu_flash" if (i + world + causal) % 2 else "reference"
                backward = ("burst", "kv", "auto")[(i + world) % 3]
                out.append((Case(world=world, local_seq=12, heads=heads, head_dim=16, causal=causal,
                                 layout="contiguous", backend=backend, backward=backward, seed=i), kind, 4))
    # other layouts, an odd world, bigger tiles, batch 2, bf16
    out += [
        (Case(world=3, local_seq=8, heads="mqa", head_dim=32, causal=True, layout="zigzag", backend="cpu_flash"),
         "window_causal", 2),
        (Case(world=3, local_seq=10, heads="gqa", head_dim=16, causal=True, layout="striped", backend="reference",
              batch=2), "docs", 4),
        (Case(world=4, local_seq=16, heads="gqa", head_dim=32, causal=True, layout="zigzag", backend="cpu_flash",
              dtype="bfloat16"), "docs_window", 8),
        (Case(world=2, local_seq=32, heads="mha", head_dim=16, causal=False, layout="striped", backend="cpu_flash"),
         "local_global", 8),
        (Case(world=4, local_seq=16, heads="mha", head_dim=16, causal=True, layout="contiguous", backend="cpu_flash",
              softmax_scale=0.3), "window_causal", 64),
        (Case(world=2, local_seq=12, heads="gqa", head_dim=16, causal=True, layout="zigzag", backend="auto",
              dtype="float64"), "docs_window", 4),
        # the document-aware partition as the layout
        (Case(world=2, local_seq=12, heads="gqa", head_dim=16, causal=True, layout="documents", backend="cpu_flash"),
         "docs", 4),
        (Case(world=3, local_seq=10, heads="mha", head_dim=16, causal=True, layout="documents", backend="reference",
              backward="kv"), "docs_window", 4),
        (Case(world=4, local_seq=16, heads="gqa", head_dim=32, causal=False, layout="documents", backend="cpu_flash"),
         "docs", 8),
        (Case(world=4, local_seq=8, heads="mha", head_dim=16, causal=True, layout="documents", backend="reference"),
         "one_doc", 4),
    ]
    return out


def _check(case: Case, kind: str, block: int, results: list[dict]) -> None:
    ref = masks.reference(case, kind, block)
    got = {}
    names = ("out", "lse", "dq", "dk", "dv") if results[0]["lse"] is not None else ("out", "dq", "dk", "dv")
    for name in names:
        dim = 2 if name == "lse" else 1
        shape = list(results[0][name].shape)
        shape[dim] = case.seq_len
        full = torch.empty(shape, dtype=results[0][name].dtype)
        for r in results:
            full.index_copy_(dim, r["positions"], r[name])
        got[name] = full
    for name in ("out", "dq", "dk", "dv"):
        assert torch.isfinite(got[name]).all(), name
    blind = torch.isinf(ref["lse"])
    if "lse" not in got:  # strategies without return_lse: check the output only
        got["lse"] = ref["lse"]
    assert torch.equal(torch.isinf(got["lse"]) & (got["lse"] < 0), blind), "LSE -inf exactly on rows that see nothing"
    if blind.any():
        assert (got["out"].transpose(1, 2)[blind] == 0).all()
    if case.dtype not in EXACT:  # 16-bit: flash-attn's rule, with the same mask
        n = case.seq_len
        dense = masks.build(kind, n, block).dense(torch.arange(n), torch.arange(n), n, case.causal)
        bad = tolerance_failures(case.with_(causal=False), got, ref, mask=dense)
        assert not bad, bad
        return
    # relative error; a gradient that is exactly 0 in exact arithmetic (dq, dk when every row sees
    # one key: float32 leaves ~1e-7 * |dO| |v| there) is measured against the scale of dv instead
    floor = float(ref["dv"].norm())
    errors = {name: float((got[name].double() - ref[name]).norm() / max(float(ref[name].norm()), floor))
              for name in ("out", "dq", "dk", "dv")}
    errors["lse"] = rel_err(got["lse"][~blind], ref["lse"][~blind]) if (~blind).any() else 0.0
    assert all(e <= EXACT[case.dtype] for e in errors.values()), errors


@pytest.mark.parametrize("case,kind,block", _cases(), ids=lambda x: x.id() if isinstance(x, Case) else str(x))
def test_mask_matches_reference_and_formula(pools, case, kind, block):
    results = pools.get(case.world).run(masks.masked, case, kind, block)
    _check(case, kind, block, results)
    for rank, r in enumerate(results):
        assert {k: v for k, v in r["sent"].items() if v} == {k: v for k, v in r["formula"].items() if v}, rank


def test_window_skips_traffic_and_steps(pools):
    """A causal window narrower than a shard over the contiguous layout: 2 steps, one K/V block sent
    by every rank but the last, instead of the ring's P-1."""
    case = Case(world=4, local_seq=16, heads="mha", head_dim=16, causal=True, layout="contiguous",
                backend="cpu_flash", backward="kv")
    results = pools.get(4).run(masks.masked, case, "window_causal", 4)
    kv_block = 2 * case.local_seq * case.kv_heads * case.head_dim * 4
    for rank, r in enumerate(results):
        assert r["steps"] == 2  # its own block, then one step that receives and/or sends
        assert r["sent"][("forward", "kv")] == (kv_block if rank < 3 else 0)


def test_documents_inside_ranks_send_nothing(pools):
    """Documents that never cross a shard boundary: no K/V moves at all."""
    case = Case(world=4, local_seq=8, heads="mha", head_dim=16, causal=True, layout="contiguous", backend="reference")
    results = pools.get(4).run(masks.masked_docs_aligned, case)
    for r in results:
        assert r["kv_sent"] == 0 and r["steps"] == 1
        assert torch.isfinite(r["out"]).all()


def test_raw_arguments_equal_prebuilt_mask(pools):
    case = Case(world=2, local_seq=12, heads="gqa", head_dim=16, causal=True, layout="contiguous", backend="cpu_flash")
    a = pools.get(2).run(masks.masked, case, "docs_window", 256, "args")
    b = pools.get(2).run(masks.masked, case, "docs_window", 256, "mask")
    for ra, rb in zip(a, b):
        assert torch.allclose(ra["out"], rb["out"], atol=1e-6) and torch.allclose(ra["dq"], rb["dq"], atol=1e-6)


BAD = [
    (dict(window=(-2, 0)), "window left must be an int >= 0"),
    (dict(window=(2,)), "window must be a pair"),
    (dict(cu_seqlens=[0, 5, 3, 16]), "strictly increasing"),
    (dict(cu_seqlens=[1, 5, 16]), "start at 0"),
    (dict(cu_seqlens=[0, 5, 15]), "must end at the global sequence length 16"),
    (dict(cu_seqlens=[0, 16], document_ids=[0] * 16), "not both"),
    (dict(document_ids=[0, 0, 1, 1, 0, 0] + [2] * 10), "one contiguous run"),
    (dict(mask_mod=masks.raises), "mask_mod raised RuntimeError: boom"),
    (dict(mask_mod=masks.not_bool), "mask_mod must return a bool tensor"),
    (dict(mask_mod=3), "mask_mod must be callable"),
    (dict(window=(2, 0), schedule="distflash", causal=True), "distflash"),
]


@pytest.mark.parametrize("kwargs,needle", BAD, ids=[b[1][:30] for b in BAD])
def test_bad_masks_raise_on_every_rank(pools, kwargs, needle):
    for kind, message in pools.get(2).run(masks.bad_mask, kwargs):
        assert kind == "ValueError" and needle in message, message


def test_bad_mask_on_one_rank_raises_on_every_rank(pools):
    res = pools.get(2).run(masks.bad_mask, dict(mask_mod=masks.raises), 1)
    assert res[1][0] == "ValueError" and "boom" in res[1][1]
    assert res[0][0] == "ValueError" and "rank 1" in res[0][1] and "boom" in res[0][1]


def test_ranks_with_different_masks_raise(pools):
    res = pools.get(2).run(masks.bad_mask, dict(window=(3, 0)), 0)
    assert len({tuple(r) for r in res}) == 1, res  # the same type and message on every rank
    for kind, message in res:  # a Disagreement is a ValueError naming the differing field
        assert kind == "Disagreement" and "mask" in message and "same on every rank" in message, message


STRATEGY_CASES = [
    (strategy, Case(world=world, local_seq=12, heads=heads, head_dim=16, causal=causal, layout=layout,
                    backend=backend, seed=world), kind)
    for strategy, layout in (("ring", "contiguous"), ("allgather", "zigzag"), ("ulysses", "contiguous"))
    for world, heads, backend in ((1, "gqa", "cpu_flash"), (2, "gqa", "reference"), (4, "4/2", "cpu_flash"))
    for causal, kind in ((True, "docs_window"), (False, "blind_rows"), (True, "window_causal"))
] + [  # the document-aware partition as the layout of the strategies that place tokens by position
    (strategy, Case(world=world, local_seq=12, heads="4/2", head_dim=16, causal=True, layout="documents",
                    backend="cpu_flash", seed=3), "docs")
    for strategy in ("allgather", "ulysses") for world in (2, 4)
]


@pytest.mark.parametrize("strategy,case,kind", STRATEGY_CASES,
                         ids=[f"{s}-{c.id()}-{k}" for s, c, k in STRATEGY_CASES])
def test_masks_on_other_strategies(pools, strategy, case, kind):
    """ring (sparse schedule, K/V backward), allgather and ulysses (all traffic, only non-empty
    blocks computed) against the same oracle; their bytes equal their formulas."""
    results = pools.get(case.world).run(masks.masked, case, kind, 4, "args", strategy)
    _check(case, kind, 4, results)
    for rank, r in enumerate(results):
        assert {k: v for k, v in r["sent"].items() if v} == {k: v for k, v in r["formula"].items() if v}, rank

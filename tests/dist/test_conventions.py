"""flash-attn's conventions and the edges of the call options: windows with -1, deterministic
results, dropout refused, one empty-row LSE convention, clear refusals on every rank (naming what
does support the call), and torch.compile(fullgraph=True) with the new arguments."""
from __future__ import annotations

import pytest
import torch

from tests.dist.cases import features as cc


def test_window_minus_one_means_unbounded(pools):
    for r in pools.get(2).run(cc.windows):
        assert torch.equal(r["none"][0], r["minus"][0]) and r["none"][1] == r["minus"][1]  # dense ring, same bytes
        assert torch.equal(r["left_none"][0], r["left_minus"][0])


@pytest.mark.parametrize("world", [1, 2])
def test_deterministic_is_bitwise_repeatable(pools, world):
    assert all(pools.get(world).run(cc.deterministic))


def test_empty_rows_lse_convention(pools):
    """A row that sees no key: output 0 and LSE -inf; with sinks, LSE = the sink logit, output 0."""
    results = pools.get(2).run(cc.empty_rows)
    assert any(r["blind"].any() for r in results) and not all(r["blind"].all() for r in results)
    for r in results:
        blind = r["blind"]
        assert torch.isneginf(r["lse"][:, :, blind]).all() and torch.isfinite(r["lse"][:, :, ~blind]).all()
        assert (r["out"][:, blind] == 0).all() and (r["out_s"][:, blind] == 0).all()
        sinks = r["sinks"].view(1, -1, 1).expand(r["lse_s"].shape[0], -1, int(blind.sum()))
        assert torch.equal(r["lse_s"][:, :, blind], sinks)
        assert not torch.isnan(r["out_s"]).any()


REFUSED = {
    "dropout": ("ValueError", "dropout_p=0.1: attention dropout is not supported"),
    "softcap_backend": ("ValueError", "backend 'cpu_flash' does not support softcap on 'cpu'; backends that do: "
                                      "['reference']"),
    "negative_softcap": ("ValueError", "softcap must be None or a positive finite number"),
    "alibi_shape": ("ValueError", "alibi_slopes must have shape [4] or [1, 4], got [3]"),
    "sinks_shape": ("ValueError", "sinks must have shape [4], got [2, 4]"),
    "sinks_int": ("TypeError", "sinks must be a floating-point torch.Tensor"),
    "max_seqlen": ("ValueError", "max_seqlen_q=2 is shorter than the longest document"),
    "docs_count": ("ValueError", "cu_seqlens_k must describe as many documents"),
    "docs_without_k": ("ValueError", "give the keys' documents as cu_seqlens_k"),
    "zigzag_odd_keys": ("ValueError", "needs an even key shard length"),
    "distflash_cross": ("ValueError", "run on schedule='ring'"),
    "ulysses_softcap": ("ValueError", "does not take option(s) ['softcap']"),
    "allgather_cross": ("ValueError", "run on strategy 'burst' or 'ring'"),
    "tp_v_head_dim": ("ValueError", "one head size for q, k and v"),
    "ranks_differ": ("Disagreement", "must be the same on every rank"),  # a ValueError naming the field
}


@pytest.mark.parametrize("kind", list(REFUSED))
def test_refused_on_every_rank(pools, kind):
    want_type, needle = REFUSED[kind]
    for got_type, message in pools.get(2).run(cc.refused, kind):
        assert got_type == want_type and needle in message, message


def test_ulysses_refusal_names_the_strategies_that_take_it(pools):
    for _, message in pools.get(2).run(cc.refused, "ulysses_softcap"):
        assert "strategies that take ['softcap']: ['burst', 'ring']" in message, message


@pytest.mark.parametrize("kind", ["dropout", "sinks_shape", "max_seqlen"])
def test_bad_argument_on_one_rank_raises_on_every_rank(pools, kind):
    res = pools.get(2).run(cc.refused, kind, 1)
    assert REFUSED[kind][1] in res[1][1]
    assert res[0][0] == REFUSED[kind][0] and "rank 1" in res[0][1] and REFUSED[kind][1] in res[0][1], res[0]


@pytest.mark.parametrize("strategy", ["burst_attn_func", "ring"])
def test_compile_fullgraph_with_new_arguments(pools, strategy):
    for diffs in pools.get(2).run(cc.compiled_vs_eager, strategy):
        assert max(diffs.values()) == 0.0, diffs

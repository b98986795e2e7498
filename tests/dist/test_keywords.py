"""One front door vocabulary in real process groups (worlds 2 and 3): for every keyword of ``burst_attn_func``
with a value other than its default, ``attention(strategy="burst", **kw)`` and ``BurstAttention(**kw)`` give
exactly ``burst_attn_func(**kw)`` (outputs, LSE, every gradient; or the same error), and every other strategy
either runs it (close to burst's result) or refuses it naming the strategy and the keyword."""
from __future__ import annotations

import pytest
import torch

from burstattn.call.options import KEYWORDS, SPELLINGS
from burstattn.strategies import STRATEGIES
from tests.dist.cases import features

WORLDS = [2, 3]


def test_every_keyword_has_a_case():
    """Adding a keyword to the vocabulary without a case here fails: every door is then tested with it."""
    assert set(features.KEYWORD_CASES) == set(KEYWORDS) | set(SPELLINGS) | {"options"}


def _same(a, b) -> bool:
    if isinstance(a, tuple) or isinstance(b, tuple):
        return a == b
    return all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
               for x, y in zip(a, b))


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("keyword", sorted(features.KEYWORD_CASES))
def test_attention_burst_equals_burst_attn_func(pools, world, keyword):
    for rank, res in enumerate(pools.get(world).run(features.every_door, keyword)):
        want = res["burst_attn_func"]
        for door in ("attention", "BurstAttention"):
            assert _same(res[door], want), (rank, door, res[door] if isinstance(res[door], tuple) else "values")
        if keyword != "dropout_p":
            assert not isinstance(want, tuple), want  # the case is a valid call


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("keyword", sorted(set(features.KEYWORD_CASES) - {"group", "causal", "softmax_scale", "layout"}))
def test_other_strategies_take_or_refuse_naming_the_strategy(pools, world, keyword):
    """A strategy that takes the keyword runs it (within 1e-9 of burst in float64, or the same error); one that
    does not refuses it on every rank, naming the strategy and the keyword as given."""
    name = SPELLINGS.get(keyword, keyword)
    for rank, res in enumerate(pools.get(world).run(features.other_strategies, keyword)):
        for strategy, (what, detail) in res.items():
            takes = name in STRATEGIES[strategy].options or (
                keyword == "options" and {"backward", "cu_seqlens", "window"} <= set(STRATEGIES[strategy].options))
            if keyword == "dropout_p" and takes:
                assert what == "error" and "dropout" in detail, (rank, strategy, what, detail)
            elif takes:
                assert what == "ran" and detail < 1e-9, (rank, strategy, what, detail)
            else:
                assert what == "refused", (rank, strategy, what, detail)
                assert f"strategy {strategy!r} does not support" in detail, detail
                shown = {"options": "backward=" if "backward" not in STRATEGIES[strategy].options else "cu_seqlens="}
                shown = shown.get(keyword, f"{keyword}=")
                assert shown in detail, (strategy, detail)

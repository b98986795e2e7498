"""Bad inputs raise a clear ValueError/TypeError on EVERY rank, naming the argument, including
when only rank 1 is wrong (the other ranks must not hang waiting for it in the ring)."""
from __future__ import annotations

import re

import pytest

from tests.dist.cases import attention

# scenario -> (allowed exception types, words the message must contain); see cases/attention._bad_args
SCENARIOS = {
    "ndim": ({"ValueError"}, ["q"]),
    "not_tensor": ({"TypeError"}, ["q"]),
    "batch": ({"ValueError"}, ["batch"]),
    "head_dim": ({"ValueError"}, ["head_dim"]),
    "dtype_mix": ({"TypeError", "ValueError"}, ["dtype"]),
    "device": ({"ValueError"}, ["device"]),
    "heads": ({"ValueError"}, ["kv_heads"]),
    "zigzag_odd": ({"ValueError"}, ["local_seq"]),
    "layout": ({"ValueError"}, ["layout", "diagonal"]),
    "backend": ({"ValueError"}, ["backend", "triton"]),
    "backward": ({"ValueError"}, ["backward", "both"]),
    "flash_attn": ({"ValueError"}, ["flash_attn", "available", "cpu_flash", "reference"]),
    "sdpa": ({"ValueError"}, ["sdpa", "available", "cpu_flash", "reference"]),
    "softmax_scale": ({"ValueError"}, ["softmax_scale"]),
}
ONE_RANK = {  # only rank 1 differs; what every rank must report
    "ndim@1": ({"ValueError"}, ["q"]),
    "heads@1": ({"ValueError"}, ["kv_heads"]),
    "zigzag_odd@1": ({"ValueError"}, ["local_seq"]),
    "local_seq@1": ({"ValueError"}, ["local_seq"]),
    "dtype_rank@1": ({"TypeError", "ValueError"}, ["dtype"]),
    "dtype_mix@1": ({"TypeError", "ValueError"}, ["dtype"]),
    "device@1": ({"ValueError"}, ["device"]),
    "causal@1": ({"ValueError"}, ["causal"]),
    "layout@1": ({"ValueError"}, ["layout"]),
    "backend@1": ({"ValueError"}, ["backend"]),
    "backward@1": ({"ValueError"}, ["backward"]),
    "flash_attn@1": ({"ValueError"}, ["flash_attn"]),
    "softmax_scale@1": ({"ValueError"}, ["softmax_scale"]),
}


def check_all_ranks(results, types, words, what):
    # ranks that disagree raise burstattn.comm.agree.Disagreement, a ValueError naming the differing field
    results = [("ValueError" if kind == "Disagreement" else kind, msg) for kind, msg in results]
    kinds = {kind for kind, _ in results}
    assert len(kinds) == 1 and kinds <= types, f"{what}: exception types by rank {[k for k, _ in results]}"
    for rank, (_, msg) in enumerate(results):
        for word in words:
            assert re.search(rf"\b{re.escape(word)}\b", msg), f"{what}: rank {rank} message lacks {word!r}: {msg!r}"


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_bad_input_every_rank(pools, world, scenario):
    types, words = SCENARIOS[scenario]
    check_all_ranks(pools.get(world).run(attention.bad_input, scenario), types, words, scenario)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("scenario", sorted(ONE_RANK))
def test_bad_input_on_one_rank_raises_on_every_rank(pools, world, scenario):
    """The same exception type and message on every rank, naming rank 1 or the differing argument."""
    types, words = ONE_RANK[scenario]
    results = pools.get(world).run(attention.bad_input, scenario)
    assert len(set(results)) == 1, f"{scenario}: {results}"
    check_all_ranks(results[1:2], types, words, scenario)
    assert {kind for kind, _ in results} == {results[1][0]}, f"{scenario}: types by rank {results}"
    for rank, (_, msg) in enumerate(results):
        names_rank = re.search(r"\brank(\(s\))?\s*\[?1\b", msg) is not None
        assert names_rank or all(word in msg for word in words), f"{scenario}: rank {rank}: {msg!r}"


@pytest.mark.parametrize("scenario", sorted(ONE_RANK))
def test_bad_input_on_one_rank_is_named_on_every_rank(pools, scenario):
    """The ranks that passed good input also say which argument was wrong (not only "rank 1")."""
    types, words = ONE_RANK[scenario]
    check_all_ranks(pools.get(3).run(attention.bad_input, scenario), types, words, scenario)


def test_good_input_after_bad_input_still_works(pools):
    """The group is usable after every rank raised (no half-finished collective left behind)."""
    pool = pools.get(3)
    pool.run(attention.bad_input, "local_seq@1")
    assert pool.run(attention.bad_input, "none@1") == [("no error", "")] * 3


@pytest.mark.parametrize("layout,seq_len", [("zigzag", 6), ("zigzag", 3), ("striped", 5), ("contiguous", 3),
                                            ("contiguous", 0)])
def test_shard_sequence_rejects_lengths_the_layout_cannot_split(pools, layout, seq_len):
    check_all_ranks(pools.get(2).run(attention.bad_shard, layout, seq_len), {"ValueError"},
                    ["layout", str(seq_len)], f"{layout} N={seq_len}")


def test_shard_sequence_rejects_unknown_layout(pools):
    check_all_ranks(pools.get(2).run(attention.bad_shard, "spiral", 8), {"ValueError"}, ["layout", "spiral"], "spiral")

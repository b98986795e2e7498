"""burstattn.comm.agree at worlds 2 and 3: one 8-byte digest per rank when the ranks agree; otherwise
every rank raises the same exception type and message, naming the differing field(s) and the values in
rank order, or the problem and the rank(s) that found it."""
from __future__ import annotations

import pytest

from tests.dist.cases import agreement as ac


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_raises_the_same(pools, world):
    pool = pools.get(world)
    assert pool.run(ac.exchange, "same") == [("no error", str((world - 1) * 8))] * world
    seeds = ", ".join(["1"] * (world - 1) + ["2"])
    want = {
        "value": ("Disagreement", f"check: seed must be the same on every rank of the group, got [{seeds}] (rank order)"),
        "alone": ("Disagreement", "check: function must be the same on every rank of the group, got ['g', "
                                  + ", ".join(["'f'"] * (world - 1)) + "] (rank order)"),
        "problem": ("ValueError", f"check: q must be 4-D (rank 1 of {world}; every rank aborts)"),
        "every": ("ValueError", "check: bad everywhere"),
    }
    for kind, expected in want.items():
        assert pool.run(ac.exchange, kind) == [expected] * world, kind
    if world == 3:  # two ranks with problems of their own: the lowest one's type, both named
        assert pool.run(ac.exchange, "problems") == [("TypeError", "check: invalid arguments on 2 of 3 ranks, every "
                                                      "rank aborts (rank 1: bad dtype 1; rank 2: bad shape)")] * 3


# Each library check that compares across ranks, given an input wrong on one rank or differing on the last:
# (the exception type every rank raises, a text its message must hold).
SITES = {
    "attention_shapes": ("Disagreement", "local_seq (q.shape[1]) must be the same on every rank of the group"),
    "attention_problem": ("ValueError", "(rank 1 of {world}; every rank aborts)"),
    "attention_strategy": ("Disagreement", "function (burst_attn_func or the attention strategy) must be the same"),
    "delta_rule": ("Disagreement", "chunk_size must be the same on every rank of the group, got [{chunks}]"),
    "conv": ("Disagreement", "width must be the same on every rank of the group, got [{widths}]"),
    "generate": ("Disagreement", "the prompt (shape, token ids) must be the same on every rank of the group"),
    "dispatch": ("Disagreement", "the global batch (sequences and lengths) must be the same"),
    "mask_mod": ("ValueError", "during the attention pass: mask_mod raised IndexError: out of range "
                               "(rank 1 of {world}; every rank aborts)"),
    "hf_batch": ("Disagreement", "shard_batch: input_ids must be the same on every rank of the group"),
    "hf_cache": ("Disagreement", "the tokens fed (checksum of the first layer's new keys) must be the same"),
}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", sorted(SITES))
def test_each_check_raises_the_same_on_every_rank(pools, world, name):
    if name.startswith("hf_"):
        pytest.importorskip("transformers", minversion="5")
    results = pools.get(world).run(ac.site, name)
    kind, needle = SITES[name]
    needle = needle.format(world=world, chunks=", ".join(["2"] * (world - 1) + ["4"]),
                           widths=", ".join(["4"] * (world - 1) + ["5"]))
    assert len(set(results)) == 1, results  # the same type and message on every rank
    assert results[0][0] == kind and needle in results[0][1], results[0]

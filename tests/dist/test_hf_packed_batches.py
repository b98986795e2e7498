"""Packed documents and padding through the Hugging Face path, and the refusals
(the whole batch on every rank, a layout mismatch, per-rank sampling), at several world sizes, odd ones included, against the eager single-process model.

Float32 throughout: loss, gathered logits and summed gradients within 1e-4 (as tests/dist/test_hf.py).
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", minversion="5")

from tests.dist.cases import hf_trainer as pc  # noqa: E402

TOL = 1e-4
PC = pc.PackCase
CASES = [(1, PC()), (2, PC()), (3, PC(strategy="ring", lengths=(20, 4, 4, 2, 6))),
         (2, PC(kind="qwen3", strategy="ulysses", mode="flash")), (4, PC(kind="mistral", lengths=(30, 3, 7))),
         (2, PC(kind="qwen2", strategy="allgather", mode="right", lengths=(17, 5, 11))),
         (3, PC(kind="llama", mode="left", lengths=(17, 5, 11))), (2, PC(kind="mistral", mode="left", lengths=(19, 4, 12))),
         (2, PC(mode="packed", layout="zigzag")), (2, PC(mode="right", lengths=(9, 9, 9)))]


@pytest.mark.parametrize("world,case", CASES, ids=[f"w{w}-{c.id()}" for w, c in CASES])
def test_packed_and_padded_equal_eager(pools, world, case):
    for rank, res in enumerate(pools.get(world).run(pc.pack_or_pad, case)):
        assert res["loss_err"] <= TOL and res["logits_err"] <= TOL and res["grad_err"] <= TOL, (rank, res)
        if case.mode == "right" and len(set(case.lengths)) == 1:
            assert res["docs"] is None, res  # an all-ones mask: rows kept, no document mask
        else:
            assert res["docs"] >= len(case.lengths), res  # documents (and pad runs) became the mask


REFUSED = [("usp", "cannot honour packed documents or padding"), ("tp", "cannot honour"),
           ("rsa", "cannot honour"), ("hole", "zeros between real tokens"), ("4d", "2-D padding mask"),
           ("full_batch", "shard_batch"), ("full_batch_positions", "shard_batch"),
           ("different_batches", "must be the same on every rank")]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("what,expect", REFUSED, ids=[w for w, _ in REFUSED])
def test_refused_on_every_rank(pools, world, what, expect):
    if what == "usp" and world == 3:
        pytest.skip("usp over 3 ranks needs 3 | heads")
    for rank, msg in enumerate(pools.get(world).run(pc.refused, what)):
        assert expect in msg, (rank, msg)
        if what in ("usp", "tp", "rsa"):
            assert "burst" in msg and "ring" in msg, msg  # names what works


def test_layout_registered_is_used_and_mismatch_raises(pools):
    for rank, res in enumerate(pools.get(2).run(pc.layout_mismatch)):
        assert abs(res["loss"] - res["ref"]) <= TOL, res
        assert "registered with layout='striped'" in res["messages"][0], res
        assert "not its share of layout 'striped'" in res["messages"][1], res


@pytest.mark.parametrize("world,kind", [(2, "llama"), (3, "mistral")])
def test_greedy_generation_from_padded_batch(pools, world, kind):
    for res in pools.get(world).run(pc.padded_generation, kind):
        assert torch.equal(res["tokens"], res["ref"]), res


def test_sampling_ranks_agree_or_raise(pools):
    raised = pools.get(2).run(pc.sampling, False)
    assert len(set(raised)) == 1, raised  # the same message on every rank
    assert raised[0].startswith("Disagreement") and "the tokens fed" in raised[0], raised
    same = pools.get(2).run(pc.sampling, True)
    assert same[0].startswith("tokens") and same[0] == same[1], same

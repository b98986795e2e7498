"""The blockwise causal-LM loss of the Hugging Face path: ``burstattn.hf.causal_lm_loss`` from the
last hidden states in chunks (not dividing the local length; one token) equals transformers' loss
on the same ``shard_batch`` (the global mean over the targets) and gives the same gradients."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="the Hugging Face integration needs transformers (the test extra)")

from tests.dist.cases.hf_models import blockwise_hf_loss  # noqa: E402


@pytest.mark.parametrize("world,chunk,seq", [(1, 5, 23), (2, 3, 24), (2, 1, 20), (2, 1024, 24)])
def test_blockwise_loss_equals_transformers_loss(pools, world, chunk, seq):
    for r in pools.get(world).run(blockwise_hf_loss, chunk, seq):
        assert r["loss"] == pytest.approx(r["ref"], rel=1e-6)
        assert r["grad_err"] < 1e-6
        assert "chunk_size" in r["refused"]


@pytest.mark.parametrize("world,chunk,seq", [(1, 5, 23), (2, 3, 24), (2, 1024, 24)])
def test_fused_loss_equals_transformers_loss(pools, world, chunk, seq):
    """``fused=True``: each chunk's gradients computed in the forward; the same loss and gradients
    (float32, 1e-6), also with a final logit softcap against the unfused chunks."""
    for r in pools.get(world).run(blockwise_hf_loss, chunk, seq, True):
        assert r["loss"] == pytest.approx(r["ref"], rel=1e-6)
        assert r["grad_err"] < 1e-6
        assert r["softcap"][0] < 1e-6 and r["softcap"][1] < 1e-6, r["softcap"]

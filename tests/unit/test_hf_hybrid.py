"""burstattn.hf.patch_mixers without a process group: the table, idempotence, the module's own
forward on one process without a sharded batch, and what check_model says before and after."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers", minversion="5")

import torch  # noqa: E402

import burstattn.hf as bhf  # noqa: E402
from burstattn.hf.mixer_table import REFUSED, SUPPORTED  # noqa: E402
from tests.dist.hf_hybrid_cases import _tokens, build  # noqa: E402


def test_patch_is_idempotent_and_keeps_the_single_process_forward():
    model = build("lfm2")
    ids = _tokens(1, 11)
    with torch.no_grad():
        before = model(input_ids=ids).logits
    with pytest.raises(ValueError, match="Lfm2ShortConv is sequence parallel after burstattn.hf.patch_mixers"):
        bhf.check_model(model)
    assert bhf.patch_mixers(model) == ["model.layers.0.conv", "model.layers.2.conv"]
    assert bhf.patch_mixers(model) == []  # already patched
    assert bhf.sequence_mixers(model) == []
    with torch.no_grad():  # no shard_batch batch, one process: transformers' own forward, bit for bit
        assert torch.equal(model(input_ids=ids).logits, before)


def test_table_names_are_disjoint_and_refused_ones_say_why():
    assert not set(SUPPORTED) & set(REFUSED)
    assert {r for _, r in SUPPORTED.values()} == {"gdn", "kda", "ssd", "lightning", "conv"}
    from tests.dist.hf_guard_cases import build as guard_build

    jamba = guard_build("jamba", attn="eager")
    bhf.patch_mixers(jamba)
    with pytest.raises(ValueError, match=r"JambaMambaMixer: Mamba \(v1\)'s selective scan"):
        bhf.check_model(jamba)

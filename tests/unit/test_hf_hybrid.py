"""burstattn.hf.patch_mixers without a process group: the table, idempotence, the module's own
forward on one process without a sharded batch, and what check_model says before and after."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers", minversion="5")

import torch  # noqa: E402

import burstattn.hf as bhf  # noqa: E402
from burstattn.hf.hybrid_mixers import REFUSED, SUPPORTED  # noqa: E402
from tests.dist.cases.hf_hybrid import _batch_tokens, build_hybrid  # noqa: E402


def test_patch_is_idempotent_and_keeps_the_single_process_forward():
    model = build_hybrid("lfm2")
    ids = _batch_tokens(1, 11)
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
    from tests.dist.cases.hf_hybrid import build_guard_model

    jamba = build_guard_model("jamba", attn="eager")
    bhf.patch_mixers(jamba)
    with pytest.raises(ValueError, match=r"JambaMambaMixer: Mamba \(v1\)'s selective scan"):
        bhf.check_model(jamba)


def test_packed_rows_through_transformers_own_hybrid_layers_are_no_reference():
    """docs/hf.md warns that transformers' own mixers run a packed row as one sequence (restarting position_ids
    notwithstanding), so a single-process Trainer with DataCollatorWithFlattening is the wrong reference for a
    packed hybrid, and says what is right; this keeps that warning true and present."""
    from pathlib import Path

    model = build_hybrid("qwen3_next")
    a, b = _batch_tokens(1, 10, 1), _batch_tokens(1, 14, 2)
    with torch.no_grad():
        packed = model(input_ids=torch.cat([a, b], 1), position_ids=torch.cat([torch.arange(10), torch.arange(14)])[None])
        alone = torch.cat([model(input_ids=a).logits, model(input_ids=b).logits], 1)
    assert float((packed.logits[:, :10] - alone[:, :10]).abs().max()) < 1e-5  # the first document: no state before
    assert float((packed.logits - alone).abs().max()) > 1e-2  # the second sees the first's state
    text = " ".join((Path(__file__).resolve().parents[2] / "docs" / "hf.md").read_text().split())
    for needle in ("Packed hybrids: the right reference", "do NOT take a plain `Trainer` with "
                   "`DataCollatorWithFlattening`", "runs each document alone", "right-padded rows"):
        assert needle in text, needle

"""The native hybrid model on one process with packed documents (float64): its logits equal each
document run alone, whichever way the attention is given the documents (``cu_seqlens``,
``document_ids``, an ``AttnMask``); a ``mask_mod`` is refused, since it does not say where documents
start. (Without the boundaries the Gated DeltaNet state and convolution ran from one document into the next.)"""
from __future__ import annotations

import pytest
import torch

from burstattn import AttnMask
from burstattn.models import AttnCall, HybridLlama, preset

LENGTHS = (7, 13, 4)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return HybridLlama(preset("hybrid-tiny").with_overrides(linear_chunk=4)).double()


def _packed(model, options: dict) -> torch.Tensor:
    tokens = torch.randint(0, 256, (1, sum(LENGTHS)), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(n) for n in LENGTHS])
    with torch.no_grad():
        packed = model(tokens, positions, attn=AttnCall("burst", options={"backend": "reference", **options}))
        alone = [model(doc, torch.arange(doc.shape[1]), attn=AttnCall("burst", options={"backend": "reference"}))
                 for doc in tokens.split(LENGTHS, dim=1)]
    return (packed - torch.cat(alone, dim=1)).abs().max()


CU = torch.tensor([0, 7, 20, 24])
IDS = torch.repeat_interleave(torch.arange(3), torch.tensor(LENGTHS))


@pytest.mark.parametrize("options", [dict(cu_seqlens=CU), dict(document_ids=IDS), dict(mask=AttnMask(cu_seqlens=CU))],
                         ids=["cu_seqlens", "document_ids", "mask"])
def test_packed_documents_equal_each_document_alone(model, options):
    assert _packed(model, options) <= 1e-12


def test_without_documents_the_state_crosses(model):
    """The check can fail: the packed row as one sequence differs from the documents alone."""
    assert _packed(model, {}) > 1e-6


def test_mask_mod_refused(model):
    with pytest.raises(ValueError, match="a mask_mod does not tell the Gated DeltaNet layers"):
        _packed(model, dict(mask_mod=lambda q, k: q >= k))

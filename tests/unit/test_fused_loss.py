"""The fused loss on one process: the loss, answer stats and every gradient of the unfused,
unchunked loss (float32, 1e-6), with tied embeddings and chunks that do not divide the rows; one
gradient for the head's weight per backward; gradients scaled by the incoming gradient."""
from __future__ import annotations

import pytest
import torch

from burstattn.models import Llama
from burstattn.models.config import preset


def _run(model, upstream: float = 1.0):
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 256, (2, 30), generator=g)
    labels = torch.randint(0, 256, (2, 30), generator=g)
    labels[:, ::3] = -100
    answer = (labels != -100) & (torch.arange(30) > 12)
    calls = []
    model.output.weight.register_hook(lambda grad: calls.append(1))
    out = model(tokens, torch.arange(30), labels=labels, total_targets=int((labels != -100).sum()), answer=answer)
    (out.loss * upstream).backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters()}, len(calls)


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("chunk", [0, 7, 1])
def test_fused_equals_unfused(tie, chunk):
    cfg = preset("tiny").with_overrides(tie_embeddings=tie, loss_chunk=0)
    torch.manual_seed(0)
    ref = Llama(cfg)
    fused = Llama(cfg.with_overrides(fused_loss=True, loss_chunk=chunk))
    fused.load_state_dict(ref.state_dict())
    (a, ga, _), (b, gb, calls) = _run(ref, 0.5), _run(fused, 0.5)
    assert float(b.loss) == pytest.approx(float(a.loss), rel=1e-6)
    assert float(b.answer_hits) == float(a.answer_hits)
    assert float(b.answer_ce) == pytest.approx(float(a.answer_ce), rel=1e-6)
    for n in ga:
        assert float((gb[n] - ga[n]).norm() / ga[n].norm()) < 1e-6, n
    assert calls == 1  # one gradient for the weight per backward, whatever the chunks


def test_fused_flag_must_be_a_bool():
    with pytest.raises(ValueError, match="fused_loss"):
        preset("tiny").with_overrides(fused_loss=1)


def test_hf_fused_loss_refuses_a_head_with_bias():
    pytest.importorskip("transformers")
    from burstattn.hf import causal_lm_loss

    class Model(torch.nn.Module):
        def get_output_embeddings(self):
            return torch.nn.Linear(8, 16, bias=True)

    with pytest.raises(ValueError, match="fused=True"):
        causal_lm_loss(Model(), torch.zeros(1, 4, 8), torch.zeros(1, 4, dtype=torch.long), fused=True)

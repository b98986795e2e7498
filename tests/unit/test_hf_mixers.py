"""check_model decides from what a model contains: the survey of burstattn.hf.survey
on tiny random configs, without a process group."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers", minversion="5")

import torch  # noqa: E402

import burstattn.hf as bhf  # noqa: E402
from burstattn.hf.survey import sequence_mixers, survey  # noqa: E402
from tests.dist.cases.hf_hybrid import build_guard_model  # noqa: E402


class WeirdMixer(torch.nn.Module):
    """A module the survey has never seen: mixes positions with a cumulative sum."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(hidden))

    def forward(self, x):
        return x.cumsum(1) * self.scale


@pytest.mark.parametrize("kind,mixer", [("lfm2", "Lfm2ShortConv"), ("granitemoehybrid", "GraniteMoeHybridMambaLayer"),
                                        ("minimax", "MiniMaxLightningAttention"), ("recurrent_gemma", "Conv1d"),
                                        ("qwen3_next", "Qwen3NextGatedDeltaNet"), ("bamba", "BambaMixer"),
                                        ("falcon_h1", "FalconH1Mixer"), ("jamba", "JambaMambaMixer")])
def test_hybrids_refused_by_what_they_contain(kind, mixer):
    bhf.register()
    model = build_guard_model(kind)
    assert mixer in [m.cls for m in sequence_mixers(model)]
    with pytest.raises(ValueError, match=mixer):
        bhf.check_model(model)


@pytest.mark.parametrize("kind", ["llama", "stablelm", "mixtral", "qwen2_moe"])
def test_attention_only_models_pass(kind):
    bhf.register()
    model = build_guard_model(kind)
    found = survey(model)
    assert not found.mixers and len(found.attention) == model.config.num_hidden_layers
    bhf.check_model(model)


def test_unknown_module_refused_and_supported_table_accepts_it():
    bhf.register()
    model = build_guard_model("llama")
    model.model.layers[0].mixer = WeirdMixer(64)
    with pytest.raises(ValueError, match="WeirdMixer at model.layers.0.mixer .unclassified"):
        bhf.check_model(model)
    bhf.check_model(model, supported_mixers=("WeirdMixer",))
    assert [p for p, _ in survey(model, (WeirdMixer,)).supported] == ["model.layers.0.mixer"]


def test_attention_implementation_and_router_logits():
    bhf.register()
    with pytest.raises(ValueError, match="runs attention implementation 'sdpa'"):
        bhf.check_model(build_guard_model("llama", attn="sdpa"))
    with pytest.raises(ValueError, match="'eager'"):
        bhf.check_model(build_guard_model("llama", attn="eager"))
    model = build_guard_model("mixtral")
    model.config.output_router_logits = True
    with pytest.raises(ValueError, match="output_router_logits=True"):
        bhf.check_model(model)

"""The model at world 1: same logits as transformers' Llama with the same weights, rotary
embeddings from global positions, the three checkpointing modes (gradients, attention calls)."""
from __future__ import annotations

import pytest
import torch

from burstattn.models import AttnCall, Llama, LlamaConfig, apply_rotary, preset
from burstattn.models.checkpointing import LayerRun

CFG = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48)


class CountingAttn:
    """An attention callable that counts its forward calls (state lives on the instance)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, q, k, v):
        self.calls += 1
        return AttnCall(strategy="burst", layout="contiguous", options=dict(backend="reference"))(q, k, v)


def _hf_model(model: Llama):
    transformers = pytest.importorskip("transformers")
    c = model.config
    hf_cfg = transformers.LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.dim, intermediate_size=c.ffn_dim,
                                      num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads,
                                      num_key_value_heads=c.n_kv_heads, rms_norm_eps=c.norm_eps,
                                      rope_theta=c.rope_theta, tie_word_embeddings=c.tie_embeddings,
                                      max_position_embeddings=256, attention_bias=False, mlp_bias=False)
    hf = transformers.LlamaForCausalLM(hf_cfg).double()
    names = {"tok_embeddings": "model.embed_tokens", "output": "lm_head", "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attention.wq": "self_attn.q_proj",
             "attention.wk": "self_attn.k_proj", "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
             "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj", "feed_forward.w2": "mlp.down_proj"}
    state = {}
    for name, value in model.state_dict().items():
        hf_name = "model." + name if name.startswith(("layers.", "norm.")) else name
        for ours, theirs in names.items():
            hf_name = hf_name.replace(ours, theirs)
        state[hf_name] = value.double()
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return hf


@pytest.mark.parametrize("tie", [False, True])
def test_logits_match_transformers_llama(tie):
    torch.manual_seed(0)
    model = Llama(CFG.with_overrides(tie_embeddings=tie), attn=AttnCall(options=dict(backend="reference"))).double()
    assert (model.output.weight is model.tok_embeddings.weight) == tie
    assert sum(p.numel() for p in model.parameters()) == model.config.num_params()
    hf = _hf_model(model)
    tokens = torch.randint(0, CFG.vocab_size, (2, 24))
    ours = model(tokens, torch.arange(24))
    theirs = hf(tokens).logits
    assert (ours - theirs).abs().max() < 1e-6  # HF keeps its rotary tables in float32


def test_rotary_uses_global_positions():
    x = torch.randn(1, 12, 2, 8, dtype=torch.float64)
    full = apply_rotary(x, torch.arange(12), 10000.0)
    part = apply_rotary(x[:, 8:], torch.arange(8, 12), 10000.0)  # a shard rotated by its global positions
    assert torch.equal(full[:, 8:], part)
    assert apply_rotary(x.float(), torch.arange(12), 10000.0).dtype == torch.float32
    # rotation preserves the norm of each (i, i + hd/2) pair
    assert torch.allclose(full.norm(dim=-1), x.norm(dim=-1))
    with pytest.raises(ValueError, match="positions"):
        apply_rotary(x, torch.arange(5), 10000.0)


def test_checkpointing_modes_same_gradients_and_attention_calls():
    tokens = torch.randint(0, CFG.vocab_size, (1, 16))
    grads, calls = {}, {}
    for mode in ("none", "full", "remat"):
        torch.manual_seed(1)
        counter = CountingAttn()
        model = Llama(CFG, attn=counter, checkpointing=mode).double()
        model(tokens, torch.arange(16)).logsumexp(-1).sum().backward()
        grads[mode] = {n: p.grad.clone() for n, p in model.named_parameters()}
        calls[mode] = counter.calls
    assert calls == {"none": CFG.n_layers, "full": 2 * CFG.n_layers, "remat": CFG.n_layers}
    for mode in ("full", "remat"):
        for name, g in grads["none"].items():
            assert torch.allclose(grads[mode][name], g, rtol=1e-12, atol=1e-14), (mode, name)
    with pytest.raises(ValueError, match="checkpointing"):
        LayerRun("selective")
    with pytest.raises(ValueError, match="checkpointing"):
        Llama(CFG, checkpointing="nope")


def test_presets_build():
    model = Llama(preset("tiny"))
    assert sum(p.numel() for p in model.parameters()) == preset("tiny").num_params()

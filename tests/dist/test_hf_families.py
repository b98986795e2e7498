"""The model families with their own attention options under attn_implementation="burst" at world 2, against transformers'
eager attention on one process: loss, logits and every parameter's gradient within 1e-4, greedy tokens
equal. Gemma 2 (softcap, interleaved sliding windows), gpt-oss (learned sinks and their gradient,
alternating windows, MoE), a DeepSeek-V3 MLA model (v_head_dim 16, qk head dim 24), Falcon's new decoder
architecture (GQA, parallel attention and MLP; transformers 5.25 dispatches it), T5Gemma (a
bidirectional windowed encoder, a causal decoder and cross-attention between two sharded sequences of
their own lengths). And what cannot be honoured is refused, clearly, on every rank."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="burstattn.hf needs transformers (the test extra has it)")

from tests.dist.cases import hf_models as hc  # noqa: E402

TOL = 1e-4


def _check(results: list) -> None:
    for rank, res in enumerate(results):
        assert res["grads"] > 10, res  # every parameter's gradient is compared, not a few
        assert res["loss_err"] <= TOL and res["logits_err"] <= TOL and res["grad_err"] <= TOL, (rank, res)
        assert res["tokens"].tolist() == res["ref_tokens"].tolist(), (rank, res["tokens"], res["ref_tokens"])


@pytest.mark.parametrize("kind", ["gemma2", "gpt_oss", "deepseek_v3", "falcon"])
def test_decoder_families_match_eager(pools, kind):
    if kind == "falcon" and not hc.falcon_dispatches():
        pytest.skip("this transformers' Falcon does not dispatch its attention through the interface")
    _check(pools.get(2).run(hc.decoder_only, kind))


@pytest.mark.parametrize("world", [2, 3])
def test_gemma4_kv_shared_layers_match_eager(pools, world):
    """Gemma 4's KV-shared layers attend with the keys and values of an earlier layer (sharded as it is),
    and in generation with that layer's cache shard, for the last prompt row alone (logits_to_keep)."""
    _check(pools.get(world).run(hc.decoder_only, "gemma4_kv_shared"))


def test_encoder_decoder_with_cross_attention_matches_eager(pools):
    results = pools.get(2).run(hc.encoder_decoder)
    _check(results)
    for res in results:  # the sharded greedy loop gives transformers' own generate() tokens too
        assert res["tokens"].tolist() == res["gen_tokens"].tolist()


@pytest.mark.parametrize("what,needle", [
    ("bloom", "'bloom' (BloomForCausalLM) does not dispatch its attention through transformers' AttentionInterface"),
    ("bloom_sync", "'bloom' (BloomForCausalLM) does not dispatch its attention through transformers' AttentionInterface"),
    ("t5gemma_generate", "position_ids are not its share of layout"),
    ("ulysses_sinks", "strategy 'ulysses' does not take ['sinks']"),
    ("gemma4_logits_to_keep", "(logits_to_keep) in a sequence-parallel forward, where each rank holds a shard"),
    ("unknown_kwarg", "passes ['position_bias'] to its attention, which burstattn does not know how to apply"),
    ("falcon_alibi", "'falcon' (FalconForCausalLM) has alibi=True: it adds its ALiBi bias to the attention mask"),
])
def test_unsupported_is_refused_on_every_rank(pools, what, needle):
    for text in pools.get(2).run(hc.refused, what):
        assert needle in text, text

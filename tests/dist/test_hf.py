"""transformers models with attn_implementation="burst" against the eager single-process model.

Llama, Mistral (sliding window 8, shorter than the sequence), Qwen3 and Qwen2 built from small
configs with random weights: loss, gathered logits and summed gradients within 1e-4 (float32);
greedy ``generate`` over a ShardedCache gives the same tokens; the shards stay balanced and the
bytes are the decode formula; padding masks are refused on every rank; save_pretrained /
from_pretrained from a local directory.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers", minversion="5")

from burstattn.comm.agree import DIGEST_INTS  # noqa: E402
from burstattn.infer.bytes import decode_bytes  # noqa: E402
from tests.dist.cases import hf_models as hc  # noqa: E402

TOL = 1e-4
CASES = [hc.HfCase("llama", 1), hc.HfCase("llama", 2), hc.HfCase("mistral", 3, strategy="ring"),
         hc.HfCase("qwen3", 4, strategy="ulysses", layout="zigzag"), hc.HfCase("qwen2", 2, strategy="allgather"),
         hc.HfCase("mistral", 4, strategy="burst", layout="striped", seq=30),
         hc.HfCase("llama", 2, strategy="tp", seq=17),
         hc.HfCase("qwen2", 4, strategy="usp", options=(("ulysses_degree", 2), ("ring_degree", 2)))]


@pytest.mark.parametrize("case", CASES, ids=hc.HfCase.id)
def test_loss_logits_gradients_generate(pools, case):
    results = pools.get(case.world).run(hc.train_and_generate, case)
    cached = int(results[0]["tokens"].shape[1]) - 1  # the last generated token is never fed back
    for rank, res in enumerate(results):
        assert res["loss_err"] <= TOL and res["logits_err"] <= TOL and res["grad_err"] <= TOL, (rank, res)
        assert torch.equal(res["tokens"], res["ref_tokens"]), (rank, res["tokens"], res["ref_tokens"])
        assert res["total"] == cached
        # every layer: (P-1) * B*Hq*(D+1)*4 bytes per token fed (prompt included), 2 layers
        expected = 2 * decode_bytes(batch=1, new_tokens=cached, world_size=case.world, q_heads=4, head_dim=16)
        assert res["decode_sent"] == expected, (rank, res["decode_sent"], expected)
        # plus the ranks' token agreement check: the cross-rank check's digest per forward
        forwards = 1 + case.new_tokens - 1
        assert res["agree_sent"] == forwards * (case.world - 1) * DIGEST_INTS * 8, res["agree_sent"]
        assert res["other_ops"] == [], res["other_ops"]
    lengths = [res["shard_len"] for res in results]
    assert sum(lengths) == cached and max(lengths) - min(lengths) <= 1, lengths


@pytest.mark.parametrize("world,masked_rank", [(1, 0), (2, 1), (3, 0)])
def test_padding_mask_refused_on_every_rank(pools, world, masked_rank):
    messages = pools.get(world).run(hc.padding_refused, masked_rank)
    assert len(set(messages)) == 1, messages  # the same message on every rank
    assert "padding masks are not supported" in messages[0], messages
    if world > 1:
        assert f"(rank {masked_rank} of {world}; every rank aborts)" in messages[0], messages


def test_save_pretrained_from_pretrained(pools, tmp_path):
    for res in pools.get(2).run(hc.save_load_generate, str(tmp_path / "model")):
        assert res["impl"] == "burst"
        assert torch.equal(res["tokens"], res["ref_tokens"]), res


def test_register_rejects_bad_options():
    import burstattn.hf as bhf

    with pytest.raises(ValueError, match="unknown option"):
        bhf.register(strategy="burst", causal=False)
    with pytest.raises(ValueError, match="strategy must be one of"):
        bhf.register(strategy="nope")
    with pytest.raises(ValueError, match="supports layout"):
        bhf.register(strategy="ring", layout="diagonal")  # not a layout name
    with pytest.raises(ValueError, match="needs ulysses_degree"):  # usp's degrees are options
        bhf.register(strategy="usp")
    with pytest.raises(ValueError, match="unknown option"):
        bhf.register(strategy="ring", ulysses_degree=2)
    assert bhf.register(strategy="usp", ulysses_degree=2).options == {"ulysses_degree": 2}


def test_single_process_refusals():
    """Without torch.distributed: a DynamicCache holding past tokens and attention dropout raise."""
    import burstattn.hf as bhf

    bhf.register(strategy="burst", backend="reference")
    model = hc.build_causal_lm("llama")
    model.set_attn_implementation("burst")
    ids = torch.randint(0, hc.VOCAB, (1, 8))
    with pytest.raises(ValueError, match="ShardedCache"):
        model.generate(ids, max_new_tokens=2, do_sample=False)  # default DynamicCache
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    model.train()
    with pytest.raises(ValueError, match="dropout"):
        model(input_ids=ids)


def test_core_import_does_not_import_transformers():
    probe = "import sys, burstattn; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out

"""burstattn.hf.ContextParallelTrainer against the plain single-process transformers.Trainer:
the same seed, model and examples; 3 optimizer steps.

Float32: the logged losses, gradient norms and the evaluation loss within 1e-5 relative, every parameter tensor after
the steps within 1e-5 (relative Frobenius), the predictions within 1e-4 at real tokens. Covered: packed
documents of unequal lengths (one longer than a shard, several shorter), right- and left-padded rows
(batch 3), gradient accumulation 2, dp 2 x cp 2 at world 4, Llama / Qwen2 / Qwen3 / Mistral (sliding
window 8), burst / ring / ulysses; hybrid Qwen3-Next (Gated DeltaNet, packed, SGD);
save_model; refusals on every rank.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", minversion="5")
pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (in the test extra)")

from tests.dist.cases import hf_trainer as tc  # noqa: E402
from tests.dist.cases.hf_models import VOCAB  # noqa: E402

TC = tc.TrainerCase
CASES = [TC(accumulation=2), TC(kind="qwen3", strategy="ring", data="right"),
         TC(kind="mistral", strategy="ulysses", data="left"),
         TC(kind="qwen2", world=4, cp=2, per_device=2), TC(kind="llama", world=4, cp=4, data="right", accumulation=2),
         # hybrids (the trainer patches their mixers). Qwen3-Next with SGD: transformers computes the
         # gated delta rule in float32 whatever the model's dtype, so the decay's small gradients (dt_bias,
         # in_proj_ba: ~1e-5 of the largest) differ by float32 rounding between one process and the sharded
         # run, and AdamW's first steps (~ lr * sign(g)) turn rounding into lr-sized parameter differences
         TC(kind="qwen3_next", optim="sgd")]


def _rel(a, b) -> float:
    return float((torch.as_tensor(a, dtype=torch.float64) - torch.as_tensor(b, dtype=torch.float64)).norm()
                 / torch.as_tensor(b, dtype=torch.float64).norm())


@pytest.mark.parametrize("case", CASES, ids=TC.id)
def test_trainer_equals_single_process(pools, case):
    ref = tc.reference(case)
    results = pools.get(case.world).run(tc.context_parallel, case)
    assert len(ref["losses"]) == case.steps
    for rank, res in enumerate(results):
        assert _rel(res["losses"], ref["losses"]) <= 1e-5, (rank, res["losses"], ref["losses"])
        # the gradient norms too: Adam's step is blind to a gradient's scale (double counting), the norm is not
        assert _rel(res["grad_norms"], ref["grad_norms"]) <= 1e-5, (rank, res["grad_norms"], ref["grad_norms"])
        assert abs(res["eval_loss"] - ref["eval_loss"]) <= 1e-5 * abs(ref["eval_loss"]), (rank, res["eval_loss"])
        # k_proj.bias (Qwen2) is left out: a bias on the keys adds q.b to every score of a query row, which
        # softmax ignores, so its gradient is exactly zero in exact arithmetic and float noise in both runs,
        # which Adam turns into steps of +-lr
        worst = max((_rel(p, ref["params"][k]), k) for k, p in res["params"].items() if not k.endswith("k_proj.bias"))
        assert worst[0] <= 1e-5, (rank, worst)
        pred, ref_pred = res["pred"], ref["pred"]
        lengths = tc.LENGTHS[:3]
        if case.data == "packed":  # one packed row per batch (rows are batches, not samples, under dp > 1)
            if case.world == case.cp:
                assert pred.shape == (1, sum(lengths), VOCAB), pred.shape
        else:
            assert pred.shape == ref_pred.shape == (3, max(lengths), VOCAB), (pred.shape, ref_pred.shape)
            for r, n in enumerate(lengths):
                real = slice(0, n) if case.data == "right" else slice(pred.shape[1] - n, pred.shape[1])
                assert float((pred[r, real] - ref_pred[r, real]).abs().max()) <= 1e-4, r
    if case == TC():
        assert results[0]["saved_impl"] == "sdpa" and results[0]["saved_equal"], results[0]


@pytest.mark.parametrize("what,expect", [("cp_size", "cp_size must be a positive divisor"),
                                         ("label_smoothing", "label smoothing"),
                                         ("bloom", "does not dispatch its attention through transformers'"),
                                         ("usp_padding", "cannot honour packed documents or padding")])
def test_trainer_refusals_on_every_rank(pools, what, expect):
    for rank, msg in enumerate(pools.get(2).run(tc.trainer_refusal, what)):
        assert expect in msg, (rank, msg)


def test_trl_sft_trainer_through_the_mixin(pools):
    """TRL's SFTTrainer with ContextParallelMixin (padding-free packed rows) equals the plain SFTTrainer."""
    pytest.importorskip("trl", reason="TRL is optional: pip install 'burstattn[trl]'")
    pytest.importorskip("datasets", reason="TRL's datasets")
    pytest.importorskip("tokenizers", reason="the test's word-level tokenizer (transformers' own dependency)")
    ref = tc.sft(0, 1, False)
    for rank, got in enumerate(pools.get(2).run(tc.sft, True)):
        assert len(got) == 3 and _rel(got, ref) <= 1e-5, (rank, got, ref)


@pytest.mark.parametrize("contender", ["cp-burst"])
def test_bench_hf_points(pools, contender):
    """bench hf's per-rank work on the session pool: timed steps and a measured peak."""
    from bench.hf import HfBenchConfig, trainer_rank

    cfg = HfBenchConfig(hidden=32, heads=4, kv_heads=2, vocab=64, mean_doc=40, steps=2, warmup=1)
    timed = pools.get(2).run(trainer_rank, cfg, contender, 128, True)
    peaks = pools.get(2).run(trainer_rank, cfg, contender, 128, False)
    assert all(len(r["times"]) == 2 and min(r["times"]) > 0 for r in timed), timed
    assert all(r["peak"] > 0 for r in peaks), peaks

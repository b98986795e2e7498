"""hybrid-tiny (3 Gated DeltaNet layers to 1 attention layer) trains over context-parallel ranks exactly:
3 AdamW steps give world 1's losses (relative 1e-5 per step) and parameters (relative Frobenius 1e-5 per
tensor) under several strategies and layouts, FSDP2, remat and the blockwise MLP and loss."""
from __future__ import annotations

import pytest

from burstattn.models import HybridLlama, preset
from burstattn.train import TrainConfig
from tests.dist.cases.hybrid import documents_alone, grads64
from tests.dist.cases.models import dispatch_runs, run_training

BASE = TrainConfig(model="hybrid-tiny", seq_len=120, batch=2, steps=3, lr=1e-3, warmup=1, seed=3, adam_eps=1e-5)
# adam_eps 1e-5 (test_train_exact: 1e-6): the decay gate's projection ``wa`` has gradient elements of
# ~1e-8 (softplus' flat side times exp(A_log)), where Adam's first steps turn float32 rounding of another
# summation order into steps of order lr; the float64 test below shows the gradients equal to 1e-10.
TOL = 1e-5
CASES = [(2, dict(strategy="burst")),
         (2, dict(strategy="ring", layout="contiguous", checkpointing="remat", mlp_chunk=8, loss_chunk=8)),
         (2, dict(strategy="ulysses", layout="striped", fsdp=True, checkpointing="full")),
         (3, dict(strategy="burst", fsdp=True, checkpointing="remat"))]


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


def test_hybrid_preset_shape():
    cfg = preset("hybrid-small")
    model = HybridLlama(preset("hybrid-tiny"))
    kinds = [type(layer.attention).__name__ for layer in model.layers]
    assert kinds == ["GatedDeltaNet"] * 3 + ["Attention"]
    assert sum(p.numel() for p in model.parameters()) == preset("hybrid-tiny").num_params()
    assert [cfg.is_attention(i) for i in range(cfg.n_layers)] == [False, False, False, True]


@pytest.fixture(scope="module")
def reference(pools):
    return pools.get(1).run(run_training, BASE)[0]


@pytest.mark.slow
@pytest.mark.parametrize("world,case", CASES, ids=[f"w{w}-" + "-".join(f"{k}={v}" for k, v in c.items())
                                                   for w, c in CASES])
def test_hybrid_training_matches_world_one(pools, reference, world, case, slow_selected):
    if (world, case) != CASES[0] and not slow_selected:
        pytest.skip("the suite's time on 2 cores: the first case (burst at world 2) runs always, the other strategies, "
                    "layouts, FSDP and world 3 with -m slow (the float64 gradient test covers them always)")
    out = pools.get(world).run(run_training, BASE.with_overrides(**case))[0]
    for step, (got, want) in enumerate(zip(out["losses"], reference["losses"])):
        assert abs(got - want) <= TOL * abs(want), (step, got, want)
    assert out["params"].keys() == reference["params"].keys()
    assert any("conv_weight" in n for n in reference["params"])
    worst = max((_rel(out["params"][n], reference["params"][n]), n) for n in reference["params"])
    assert worst[0] <= TOL, worst
    assert reference["losses"][2] < reference["losses"][0]  # it trains


@pytest.mark.slow
def test_hybrid_float64_gradients_match_world_one(pools):
    """The scheme is exact: float64 loss and every gradient at worlds 2 and 3, several strategies and
    layouts, against world 1 (1e-10)."""
    want = pools.get(1).run(grads64, "burst", "zigzag")[0]
    for world, strategy, layout in ((2, "ring", "contiguous"), (2, "allgather", "striped"), (3, "burst", "zigzag")):
        got = pools.get(world).run(grads64, strategy, layout)[0]
        assert abs(got["loss"] - want["loss"]) <= 1e-12 * abs(want["loss"]), (world, strategy, layout)
        worst = max((_rel(got["grads"][n], want["grads"][n]), n) for n in want["grads"])
        assert worst[0] <= 1e-10, (world, strategy, layout, worst)


# packed documents (long-tailed lengths: some span several ranks, most are packed with others on one)
DOCS = BASE.with_overrides(seq_len=96, steps=2, doc_lengths="lognormal:12,1.0,96")
DOC_ARMS = {1: [dict()], 2: [dict(cp=2), dict(dispatch="dynamic")], 3: [dict(), dict(dispatch="dynamic")]}


def _eod_file(path) -> str:
    """A text file of lines of many lengths: documents end at each newline (``--eod-id 10``)."""
    lines = [("abcdefghij" * 12)[i % 7:i % 7 + 3 + (i * 37) % 90] for i in range(40)]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_hybrid_documents_reset_state_exactly(pools, tmp_path):
    """Documents restart every Gated DeltaNet recurrence and convolution: the first step's loss (before
    any update) equals each document run alone on one process, at worlds 1, 2 and 3, static and dynamic
    dispatch, synthetic documents and a --data file cut at --eod-id; 2 steps give world 1's parameters."""
    eod = DOCS.with_overrides(doc_lengths=None, data=_eod_file(tmp_path / "docs.txt"), data_format="text",
                              eod_id=10)
    sources = [DOCS, eod]
    alone = [pools.get(1).run(documents_alone, cfg)[0] for cfg in sources]
    runs = {w: pools.get(w).run(dispatch_runs, [cfg.with_overrides(**arm) for cfg in sources for arm in arms])[0]
            for w, arms in DOC_ARMS.items()}
    reference = runs[1]
    for world, arms in DOC_ARMS.items():
        for i, got in enumerate(runs[world]):
            source, arm = divmod(i, len(arms))
            want = reference[source * len(DOC_ARMS[1])]
            assert isinstance(got, dict), (world, arms[arm], got)
            assert abs(got["losses"][0] - alone[source]) <= 1e-6 * alone[source], (world, arms[arm], got["losses"],
                                                                                    alone[source])
            for step, (a, b) in enumerate(zip(got["losses"], want["losses"])):
                assert abs(a - b) <= TOL * abs(b), (world, arms[arm], step, a, b)
            worst = max((_rel(got["params"][n], want["params"][n]), n) for n in want["params"])
            assert worst[0] <= TOL, (world, arms[arm], worst)


def test_tensor_parallelism_refused_on_every_rank(pools):
    """``build_job`` on every rank refuses TP for Gated DeltaNet layers with the documented message (it
    failed inside sp_causal_conv1d on a projection TP had split)."""
    for world in (2, 3):
        cfgs = [BASE.with_overrides(strategy="tp-v3"), BASE.with_overrides(strategy="tp-v1"),
                BASE.with_overrides(tp=world)]
        results = pools.get(world).run(dispatch_runs, cfgs)
        for i, cfg in enumerate(cfgs):
            per_rank = [r[i] for r in results]
            assert all(isinstance(m, str) and "hybrid models:" in m and "is not supported for Gated DeltaNet layers"
                       in m for m in per_rank), (world, cfg.strategy, cfg.tp, per_rank)

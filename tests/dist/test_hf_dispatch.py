"""``ContextParallelTrainer(dispatch="dynamic")``: 3 AdamW steps through the transformers
Trainer (tiny Llama, float32) give the logged losses, gradient norms and every parameter of
``dispatch="static"`` at the same world and of world 1 within 1e-6 relative; packed documents (one
longer than the others, run over both ranks; the short ones on one rank each) and right-padded rows with
gradient accumulation; bad input refused on every rank."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", minversion="5")
pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (in the test extra)")

from tests.dist.cases import hf_trainer as dc  # noqa: E402
from tests.dist.cases.hf_trainer import TrainerCase  # noqa: E402

TOL = 1e-6
# (case, the dynamic arm's dispatch_budget): packed, a budget of 20 tokens per rank puts the longest documents
# (38, 26) over several ranks and packs the short ones on one (burst); padded rows, the cost model's own choice (ring)
RUNS = [(TrainerCase(per_device=4), 20), (TrainerCase(data="right", strategy="ring", accumulation=2, per_device=2), None)]


def _rel(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).norm() / b.norm())


def _close(got: dict, want: dict, what) -> None:
    assert len(got["losses"]) == 3, (what, got["losses"])
    assert _rel(got["losses"], want["losses"]) <= TOL, (what, got["losses"], want["losses"])
    assert _rel(got["grad_norms"], want["grad_norms"]) <= TOL, (what, got["grad_norms"], want["grad_norms"])
    assert abs(got["eval_loss"] - want["eval_loss"]) <= TOL * abs(want["eval_loss"]), what
    worst = max((_rel(p, want["params"][k]), k) for k, p in got["params"].items())
    assert worst[0] <= TOL, (what, worst)


@pytest.fixture(scope="module")
def world_one(pools):
    return pools.get(1).run(dc.train, [(case, "static", None) for case, _ in RUNS])[0]


def _check_world(pools, world_one, world: int) -> None:
    runs = [(case, mode, budget if mode == "dynamic" else None) for case, budget in RUNS for mode in ("dynamic", "static")]
    results = pools.get(world).run(dc.train, runs)
    for rank, res in enumerate(results):
        for i, (case, budget) in enumerate(RUNS):
            dynamic, static = res[2 * i], res[2 * i + 1]
            _close(dynamic, static, (rank, case.id(), "static"))
            _close(dynamic, world_one[i], (rank, case.id(), "world 1"))
            if budget:  # sequences alone on a rank and sequences shared by several
                assert len(dynamic["degrees"]) > 1, dynamic["degrees"]
    assert world_one[0]["losses"][2] < world_one[0]["losses"][0]  # it trains


def test_dynamic_trainer_matches_static_and_world_one(pools, world_one):
    _check_world(pools, world_one, 2)


@pytest.mark.slow
@pytest.mark.parametrize("world", [3, 4])
def test_dynamic_trainer_at_more_ranks(pools, world_one, world):
    _check_world(pools, world_one, world)


@pytest.mark.slow
def test_dynamic_trainer_hybrid_model(pools):
    """Qwen3-Next (Gated DeltaNet mixers, sequence parallel over the micro-batch's own group), SGD as in
    test_hf_trainer.py: dynamic with documents over both ranks and alone equals static and world 1."""
    case, budget = TrainerCase(kind="qwen3_next", optim="sgd", per_device=4), 20
    want = pools.get(1).run(dc.train, [(case, "static", None)])[0][0]
    for rank, (dynamic, static) in enumerate(pools.get(2).run(dc.train, [(case, "dynamic", budget),
                                                                           (case, "static", None)])):
        assert len(dynamic["degrees"]) > 1, dynamic["degrees"]
        _close(dynamic, static, (rank, "static"))
        _close(dynamic, want, (rank, "world 1"))


@pytest.mark.parametrize("what,expect", [("differing", "must be the same on every rank"),
                                         ("cp_size", "drop cp_size"), ("strategy", "runs strategy burst"),
                                         ("mode", "dispatch must be one of"),
                                         ("budget", "exceeds the whole world's memory budget")])
def test_dynamic_trainer_refusals_on_every_rank(pools, what, expect):
    for rank, msg in enumerate(pools.get(2).run(dc.dispatch_refusal, what)):
        assert expect in msg, (rank, msg)

"""The planner offers only what ``burstattn train`` runs, and ``train`` refuses up front what it cannot:
models with Gated DeltaNet layers get no tensor parallelism (refused by ``train`` with one line before
any rank starts; excluded by the planner, whose winner for ``hybrid-small`` on 8 GPUs was a TP plan),
and ``plan --verify`` dry-runs hybrid plans (they said "no dry run": the fake mode could not read the
recurrences' host-side plans)."""
from __future__ import annotations

import json

import pytest

from burstattn.cli import main
from burstattn.models.config import preset as model_preset
from burstattn.sim.hardware import preset
from burstattn.sim.planner import excluded, plan

REFUSAL = "is not supported for Gated DeltaNet layers"
TP_FLAGS = [["--strategy", "tp-v1"], ["--strategy", "tp-v3"], ["--tp", "2"], ["--strategy", "ring", "--tp", "2"]]


@pytest.mark.parametrize("flags", TP_FLAGS, ids=[" ".join(f) for f in TP_FLAGS])
def test_tensor_parallelism_refused_for_hybrids_up_front(flags, capsys, monkeypatch):
    import burstattn.train.launcher as launcher

    monkeypatch.setattr(launcher, "run_local", lambda *a, **k: (_ for _ in ()).throw(AssertionError("spawned")))
    for extra in ([], ["--dry-run"]):
        assert main(["train", "--model", "hybrid-tiny", "--seq-len", "128", "--world-size", "2", *flags, *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith("burstattn train: error: hybrid models:") and REFUSAL in err, err
        assert err.count("\n") == 1, err


def test_planner_offers_no_tensor_parallelism_for_hybrids():
    hw = preset("a100-nvlink-ib")
    rows = plan(model_preset("hybrid-small"), 256, 8, hw, model_name="hybrid-small")
    assert rows and all(r["degrees"]["tp"] == 1 and not r["strategy"].startswith("tp") for r in rows), \
        [(r["strategy"], r["degrees"]) for r in rows]
    assert "--tp 1" in rows[0]["config"]["train"]
    why = [e.why for e in excluded(model_preset("hybrid-small"), 256, 8, hw) if e.constraint == "train-check"]
    assert any(REFUSAL in w for w in why), why
    # the same shapes with attention layers only still get tensor-parallel plans
    assert any(r["degrees"]["tp"] > 1 for r in plan(model_preset("small"), 256, 8, hw, model_name="small"))


def test_plan_verify_dry_runs_hybrids(capsys):
    assert main(["plan", "--model", "hybrid-tiny", "--seq-len", "256", "--gpus", "2", "--cluster", "h100-nvlink-ib",
                 "--verify", "2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["verified"]
    assert len(rows) == 2 and all(r["dry_run_peak_bytes"] for r in rows), rows

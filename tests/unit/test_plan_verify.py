"""``burstattn plan --verify``: the plan's ``burstattn train`` command parses to the TrainConfig that
``train`` runs; each verified plan carries ``predicted_peak_bytes`` and ``dry_run_peak_bytes`` whose
terms sum to them; a dry run that does not fit names the binding term (tiny model, seconds)."""
from __future__ import annotations

import json

from burstattn.cli import main
from burstattn.cli.verify import TERMS, compare, train_config


def test_train_config_of_plan_command():
    cfg, world = train_config("burstattn train --model tiny --seq-len 512 --batch 1 --strategy burst --world-size 2 "
                              "--dp 1 --cp 2 --tp 1 --checkpointing remat --mlp-chunk 64 --loss-chunk 32 "
                              "--offload none --dtype bfloat16 --fsdp")
    assert world == 2 and (cfg.model, cfg.seq_len, cfg.strategy, cfg.cp, cfg.checkpointing) == \
        ("tiny", 512, "burst", 2, "remat")
    assert (cfg.mlp_chunk, cfg.loss_chunk, cfg.fsdp) == (64, 32, True)


def test_compare_binds():
    dry = {"peak_bytes": 100, "peak_by_category": {"parameters": 10, "gradients": 10, "optimizer": 20,
                                                   "activations": 50, "temporaries": 10}}
    out = compare({t: 18 for t in TERMS}, 90, dry, capacity=80)
    assert out["dry_run_fits"] is False and out["binds"] == "activations"
    assert abs(out["error"] + 0.1) < 1e-12
    assert compare({}, 90, dry, capacity=None)["dry_run_fits"] is None


def test_plan_verify_json(capsys):
    assert main(["plan", "--model", "tiny", "--seq-len", "512", "--gpus", "2", "--cluster", "h100-nvlink-ib",
                 "--verify", "3", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["verified"]
    assert len(rows) == 3
    done = [r for r in rows if r["dry_run_peak_bytes"] is not None]
    assert len(done) == 3, rows  # rsa and allgather too: their plans are host-side bookkeeping
    for r in rows:
        assert "predicted_peak_bytes" in r and "dry_run_peak_bytes" in r
    for r in done:
        assert abs(sum(r["predicted_by_term"].values()) - r["predicted_peak_bytes"]) <= len(TERMS)
        assert abs(sum(r["dry_run_by_term"].values()) - r["dry_run_peak_bytes"]) <= len(TERMS)
        assert r["dry_run_fits"] is True and r["dry_run_peak_bytes"] > 0


def test_plan_verify_text_and_bad_k(capsys):
    args = ["plan", "--model", "tiny", "--seq-len", "512", "--gpus", "2", "--cluster", "h100-nvlink-ib"]
    assert main([*args, "--verify", "0"]) == 2
    err = capsys.readouterr().err
    assert "--verify" in err and err.count("\n") == 1, err

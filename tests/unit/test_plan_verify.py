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


def test_max_seq_len_verify_confirms_only_what_fits(capsys):
    """``--max-seq-len --verify``: each answer's length is dry-run; only a length whose dry run leaves the
    headroom free is confirmed, shorter ones are tried when it does not (tiny model on 2 devices of 20 MiB)."""
    from burstattn.cli.verify_len import HEADROOM

    cap = 0.02 * 2**30
    assert main(["plan", "--model", "tiny", "--gpus", "2", "--cluster", "h100-nvlink-ib", "--gpu-mem-gib", "0.02",
                 "--max-seq-len", "--verify", "1", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["confirmed"]
    checks = row["checks"]
    assert checks and checks[0]["tokens"] == row["planned_tokens"]
    assert [c["tokens"] for c in checks] == sorted((c["tokens"] for c in checks), reverse=True)
    for c in checks[:-1]:
        assert not c["fits"] and c["dry_run_peak_bytes"] > (1 - HEADROOM) * cap
    last = checks[-1]
    assert last["fits"] == (row["confirmed_tokens"] is not None)
    if last["fits"]:
        assert row["confirmed_tokens"] == last["tokens"] and last["dry_run_peak_bytes"] <= (1 - HEADROOM) * cap


def test_shorter_meets_the_limit_on_the_line_through_two_checks():
    from burstattn.cli.verify_len import _shorter

    one = [{"tokens": 100 * 1024, "dry_run_peak_bytes": 120}]
    assert _shorter(one, 100, 1024) == 83 * 1024  # 100K x 100/120, down to a step
    # a fixed part of 20 and 1 per 1,024 tokens: the line meets 100 at 80K
    two = one + [{"tokens": 90 * 1024, "dry_run_peak_bytes": 110}]
    assert _shorter(two, 100, 1024) == 80 * 1024
    # never the same length again: at least one step shorter
    assert _shorter([{"tokens": 10 * 1024, "dry_run_peak_bytes": 101}], 100.9, 1024) == 9 * 1024

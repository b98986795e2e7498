"""``burstattn train --dry-run``: a configuration ``train`` refuses is refused with the same message
(one line, exit 2, on the way in: no fake group started); bad dry-run flags name the flag; a run prints
a report and, with ``--json``, one JSON object as its last line (peaks by category and by phase, host and sent
bytes, attention calls, seconds)."""
from __future__ import annotations

import json

import pytest

from burstattn.cli import main

REFUSED = [["--world-size", "4", "--dp", "2", "--batch", "3"], ["--world-size", "3", "--strategy", "ulysses"],
           ["--world-size", "4", "--seq-len", "100"], ["--world-size", "2", "--schedule", "double"]]


@pytest.mark.parametrize("flags", REFUSED, ids=[" ".join(f) for f in REFUSED])
def test_refused_like_train(flags, capsys, monkeypatch):
    import burstattn.train.launcher as launcher

    monkeypatch.setattr(launcher, "run_local", lambda *a, **k: (_ for _ in ()).throw(AssertionError("spawned")))
    assert main(["train", *flags]) == 2
    train_err = capsys.readouterr().err
    assert main(["train", "--dry-run", *flags]) == 2
    dry_err = capsys.readouterr().err
    assert dry_err == train_err and dry_err.count("\n") == 1, (dry_err, train_err)


@pytest.mark.parametrize("flags,message", [
    (["--dry-run", "--world-size", "2048"], "--world-size must be an int from 1 to 1024"),
    (["--dry-run", "--world-size", "2", "--dry-run-rank", "2"], "--dry-run-rank must be in [0, 2)"),
    (["--json"], "--dry-run-rank and --json are options of --dry-run"),
])
def test_bad_dry_run_flags(flags, message, capsys):
    assert main(["train", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_json_report(capsys, monkeypatch):
    from tests.unit.test_plan_memo import counting_builds

    built = counting_builds(monkeypatch)
    assert main(["train", "--dry-run", "--model", "tiny", "--seq-len", "256", "--world-size", "2", "--json",
                 "--checkpointing", "remat", "--dry-run-rank", "1"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("peak_bytes", "peak_by_category", "peak_by_phase", "host_bytes", "sent_bytes", "attention_calls",
                "seconds"):
        assert key in report
    assert set(report["peak_by_category"]) == {"parameters", "gradients", "optimizer", "activations", "temporaries"}
    assert set(report["peak_by_phase"]) == {"forward", "backward", "optimizer"}
    assert report["peak_bytes"] >= max(report["peak_by_phase"].values()) - report["workspace_bytes"]
    assert report["rank"] == 1 and report["attention_calls"] == 2  # one per layer (remat: never rerun)
    # 2 layers x (forward + backward) passes, each plan built once (engine.run.PLANS): one per travelling side
    assert built and len(built) == len(set(built)), built
    assert report["sent_by_op"]["forward/kv"] > 0 and report["sent_bytes"] == sum(report["sent_by_op"].values())


def test_fused_loss_dry_runs(capsys):
    """The planner's commands carry --fused-loss: its per-row target update has no data-dependent shape
    (it failed on a fake tensor's nonzero)."""
    assert main(["train", "--dry-run", "--model", "tiny", "--seq-len", "256", "--world-size", "2", "--fused-loss",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["peak_bytes"] > 0


def test_fake_mode_failure_is_one_line(capsys, monkeypatch):
    import burstattn.train.step as step

    def host_read(params):  # a .item() the fake mode cannot follow
        return params[0].new_tensor(float(params[0].sum()))

    monkeypatch.setattr(step, "grad_norm", host_read)
    assert main(["train", "--dry-run", "--model", "tiny", "--seq-len", "256", "--world-size", "2"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "aten._local_scalar_dense" in err and "in module" in err, err


def test_tp_with_fsdp_dry_runs(capsys):
    """Ring over a cp x tp mesh with FSDP2: FSDP's per-parameter (dp x cp, tp) mesh is built on the host
    (it failed on a fake tensor's nonzero, inside DeviceMesh)."""
    assert main(["train", "--dry-run", "--model", "tiny", "--seq-len", "256", "--world-size", "4", "--strategy",
                 "ring", "--cp", "2", "--tp", "2", "--fsdp", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["dims"] == dict(dp=1, cp=2, tp=2) and report["attention_calls"] == 2, report


def test_job_build_failure_is_one_line(capsys, monkeypatch):
    import burstattn.train.job as job

    def broken(*args, **kwargs):
        raise RuntimeError("no fake kernel for this\n  and a second line")

    monkeypatch.setattr(job, "apply_fsdp", broken)
    assert main(["train", "--dry-run", "--model", "tiny", "--seq-len", "256", "--world-size", "2", "--fsdp"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot build the job: RuntimeError: no fake kernel for this" in err, err


def test_usp_dry_runs(capsys):
    """USP's ring layout and row order are host-side positions (a torch.equal on fake tensors failed)."""
    assert main(["train", "--dry-run", "--model", "tiny", "--seq-len", "512", "--world-size", "4", "--strategy",
                 "usp", "--ulysses-degree", "2", "--fsdp", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["sent_by_op"]["forward/qkv"] > 0 and report["sent_by_op"]["forward/kv"] > 0, report["sent_by_op"]


def _report(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("flags", [["--world-size", "2"], ["--world-size", "3", "--strategy", "ring", "--layout",
                                                             "contiguous", "--checkpointing", "remat"]])
def test_hybrid_dry_runs(flags, capsys):
    """Gated DeltaNet layers under the fake mode: the recurrences' segment and halo plans and their input
    check are host-side (it failed on aten._local_scalar_dense)."""
    assert main(["train", "--dry-run", "--model", "hybrid-tiny", "--seq-len", "96", *flags, "--json"]) == 0
    report = _report(capsys)
    assert report["peak_bytes"] > 0 and report["attention_calls"] == 1, report  # 1 attention layer of 4
    assert report["sent_by_op"]["forward/state"] > 0 and report["sent_by_op"]["forward/halo"] > 0, report["sent_by_op"]


def test_float16_dry_run_models_a_gpu(capsys):
    args = ["train", "--dry-run", "--model", "tiny", "--seq-len", "256", "--world-size", "2", "--json"]
    assert main([*args, "--dtype", "bfloat16"]) == 0
    bf16 = _report(capsys)
    assert main([*args, "--dtype", "float16"]) == 0
    assert _report(capsys)["peak_bytes"] == bf16["peak_bytes"]  # the same bytes per element
    assert main([*args, "--dtype", "float16", "--dry-run-device", "cpu"]) == 2  # this machine: as `train` says
    err = capsys.readouterr().err
    assert "--dtype float16 needs a GPU" in err and err.count("\n") == 1, err


def test_dry_run_says_what_it_does_not_meter(capsys):
    assert main(["train", "--dry-run", "--model", "tiny", "--seq-len", "256", "--world-size", "2", "--strategy",
                 "tp-v3"]) == 0
    out = capsys.readouterr().out
    assert "not metered: tensor parallelism's" in out, out
    assert main(["train", "--dry-run", "--model", "tiny", "--seq-len", "256", "--world-size", "2", "--json"]) == 0
    assert _report(capsys)["unmetered"] == ["the gradient all-reduce over the 2 replicas (dp x cp)"]


def test_dry_run_writes_metrics(capsys, tmp_path):
    path = tmp_path / "m.jsonl"
    assert main(["train", "--dry-run", "--model", "tiny", "--seq-len", "256", "--world-size", "2", "--json",
                 "--metrics", str(path)]) == 0
    report = _report(capsys)
    (line,) = path.read_text().splitlines()
    assert json.loads(line) == {"dry_run": True, **report}
    bad = tmp_path / "no-such-dir" / "m.jsonl"
    assert main(["train", "--dry-run", "--model", "tiny", "--seq-len", "256", "--metrics", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"--metrics {bad}: cannot write" in err and err.count("\n") == 1, err

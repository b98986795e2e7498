"""`burstattn train`'s flags are checked in the parent before any rank starts: one line on stderr,
naming the flag, exit code 2, no process spawned. Also its help and its failure report."""
from __future__ import annotations

import numpy as np
import pytest

import burstattn.train.launcher as launcher
from burstattn.cli import main
from burstattn.cli.train import report_failure
from burstattn.testing.launch import LocalGroupError, RankError


@pytest.fixture
def no_spawn(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("ranks were spawned for a configuration the parent should have refused")

    monkeypatch.setattr(launcher, "run_local", refuse)


def _token_file(tmp_path, largest):
    ids = np.arange(1024, dtype=np.uint16) % 200
    ids[7] = largest
    ids.tofile(tmp_path / "ids.bin")
    return str(tmp_path / "ids.bin")


@pytest.mark.parametrize("flags,message", [
    (["--world-size", "4", "--dp", "2", "--batch", "3"], "--batch (3) must be divisible by --dp (2)"),
    (["--world-size", "2", "--strategy", "ring", "--layout", "diagonal"], "supports layout(s)"),
    (["--world-size", "3", "--strategy", "ulysses"], "q_heads (4) must be divisible by it"),
    (["--world-size", "3", "--strategy", "tp-v3"], "needs n_heads (4) divisible by 3"),
    (["--world-size", "4", "--strategy", "usp", "--ulysses-degree", "3"], "--ulysses-degree (3) must divide --cp (4)"),
    (["--world-size", "2", "--ulysses-degree", "2"], "--ulysses-degree is an option of --strategy usp"),
    (["--world-size", "2", "--seq-len", "92"], "--seq-len >= 96"),
    (["--world-size", "4", "--seq-len", "100"], "--seq-len 100: sequence length 100 cannot be split"),
    (["--dtype", "float16"], "--dtype float16 needs a GPU"),
    (["--world-size", "2", "--schedule", "double"], "the two-level ring needs a node topology"),
    (["--world-size", "2", "--strategy", "ring", "--schedule", "distflash"], "an option of --strategy burst"),
    (["--world-size", "2", "--schedule", "distflash", "--layout", "zigzag"], "balances the contiguous layout"),
    (["--world-size", "2", "--dp", "3"], "world size 2 is not divisible by dp * tp = 3"),
    (["--vocab-size", "0"], "vocab_size must be a positive int"),
    (["--data", "missing.bin"], "--data: no such file 'missing.bin'"),
    (["--resume", "--ckpt-dir", "no/such/dir"], "--resume: --ckpt-dir 'no/such/dir' does not exist"),
])
def test_bad_flags_are_one_line_from_the_parent(capsys, no_spawn, flags, message):
    assert main(["train", "--steps", "1", "--no-progress", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("burstattn train: error: "), err
    assert message in err, err


def test_token_ids_past_the_vocabulary_name_vocab_size(capsys, no_spawn, tmp_path):
    assert main(["train", "--data", _token_file(tmp_path, 4999), "--seq-len", "128", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "holds token id 4999 but model 'tiny' has vocab_size 256: pass --vocab-size 5000" in err, err


def test_world_size_help_says_a_mismatch_under_torchrun_is_an_error(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "must equal torchrun's WORLD_SIZE" in text and "ignored" not in text
    assert "--vocab-size" in text and "--allow-changes" in text


def test_a_failure_every_rank_shares_is_printed_once(capsys):
    same = {r: RankError(r, ("ResumeError", "ValueError"), "ResumeError: --resume: no checkpoint in d loads",
                         "Traceback ...") for r in range(4)}
    assert report_failure(LocalGroupError("train on 4 ranks: 4 rank(s) raised", same, {})) == 2
    assert capsys.readouterr().err == "burstattn train: error: --resume: no checkpoint in d loads\n"
    mixed = {0: RankError(0, ("TrainingError", "RuntimeError"), "TrainingError: rank 0: a peer died", "tb"),
             1: RankError(1, (), "exited with code -9", "")}
    assert report_failure(LocalGroupError("train on 2 ranks: lost a rank", mixed, {})) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == ["burstattn train: failed: train on 2 ranks: lost a rank", "  TrainingError: rank 0: a peer died",
                   "  exited with code -9"]


def test_synthetic_task_past_the_vocabulary_names_vocab_size(capsys, no_spawn):
    # was an IndexError inside the embedding on every rank
    assert main(["train", "--world-size", "2", "--vocab-size", "100", "--seq-len", "128", "--steps", "2",
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "passkey task writes byte token ids up to 122 ('z')" in err and "--vocab-size 123" in err, err


def test_largest_passkey_id_is_what_the_rows_hold():
    from burstattn.train.data import PasskeyData

    rows = PasskeyData(0, 8, 512).batch(0).tokens
    assert int(rows.max()) <= PasskeyData.largest_id() == ord("z")


def test_data_directory_says_what_data_expects(capsys, no_spawn, tmp_path):
    assert main(["train", "--data", str(tmp_path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "is a directory; --data expects one token file" in err and "no such file" not in err, err


@pytest.mark.parametrize("content,needle", [
    (None, "cannot read it: No such file or directory"),
    ("seq_len = \n", "not valid TOML: Invalid value (at line 1, column 11)"),
    ("[train]\nseq_len = 128\nbogus = 1\n", "unknown field(s) ['bogus']"),
    ("lr = 'fast'\n", "lr must be a number, got 'fast'"),
])
def test_config_file_errors_are_one_line_naming_the_file(capsys, tmp_path, content, needle):
    path = tmp_path / "run.toml"
    if content is not None:
        path.write_text(content)
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"burstattn train: error: --config {str(path)!r}: ") and needle in err, err
    assert err.count("\n") == 1 and "Traceback" not in err, err

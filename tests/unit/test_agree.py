"""burstattn.comm.agree without a process group: the digest, the differing fields, the messages every
rank raises, and a single process raising its own problem."""
from __future__ import annotations

import pytest

from burstattn.comm.agree import (ABSENT, DIGEST_INTS, PROBLEM, Disagreement, agree, differences, digest, entries,
                                  mismatch_error, problem_error)

SIG = entries({"seed": 1, "lr": 0.001, "model": "tiny"})


def test_digest_is_fixed_size_and_covers_names_order_and_values():
    assert digest(SIG) == digest(entries({"seed": 1, "lr": 0.001, "model": "tiny"}))
    assert len(digest(SIG)) == len(digest(())) == len(digest(SIG, "bad")) == DIGEST_INTS == 1
    others = [entries({"seed": 2, "lr": 0.001, "model": "tiny"}), entries({"lr": 0.001, "seed": 1, "model": "tiny"}),
              entries({"seeds": 1, "lr": 0.001, "model": "tiny"}), SIG[:2], (("a", "b\0c"),)]
    assert len({tuple(digest(s)) for s in [SIG, *others, (("a\0b", "c"),)]}) == 7
    assert digest(SIG, "bad") == [PROBLEM] and 0 <= digest(SIG)[0] < 2 ** 32  # a CRC-32 never equals the flag


def test_differences_in_rank_order_with_absent_fields_and_alone():
    a, b = SIG, entries({"seed": 2, "lr": 0.001, "model": "small", "extra": True})
    assert differences([a, a, b]) == [("seed", ("1", "1", "2")), ("model", ("'tiny'", "'tiny'", "'small'")),
                                      ("extra", (ABSENT, ABSENT, "True"))]
    assert differences([a, b], alone=("model",)) == [("model", ("'tiny'", "'small'"))]
    assert differences([a, a]) == []


def test_mismatch_message_names_every_field_and_values():
    err = mismatch_error("train", differences([SIG, entries({"seed": 2, "lr": 0.002, "model": "tiny"})]), hint="fix")
    assert isinstance(err, Disagreement) and isinstance(err, ValueError)
    assert str(err) == ("train: seed must be the same on every rank of the group, got [1, 2] (rank order); "
                        "lr must be the same on every rank of the group, got [0.001, 0.002] (rank order); fix")
    assert err.fields == ("seed", "lr") and err.values == (("1", "2"), ("0.001", "0.002"))
    long = mismatch_error("", [("data", ("x" * 200 + "1", "x" * 200 + "2"))])
    shown = str(long)
    assert len(shown) < 250 and shown.count("...") == 2 and not shown.startswith(":")
    first, second = shown.split("[")[1].split(", ")
    assert first != second  # values that differ past the shown characters still read differently


def test_problem_messages():
    one = problem_error("f", [None, (TypeError, "bad q"), None])
    assert type(one) is TypeError and str(one) == "f: bad q (rank 1 of 3; every rank aborts)"
    every = problem_error("f", ["bad"] * 3)
    assert type(every) is ValueError and str(every) == "f: bad"
    two = problem_error("", [None, KeyError("x"), (TypeError, "y")])
    assert type(two) is KeyError and "on 2 of 3 ranks" in str(two) and "rank 1: 'x'; rank 2: y" in str(two)
    assert str(problem_error("f", [None, "same", "same"])) == "f: same (ranks [1, 2] of 3; every rank aborts)"


def test_a_single_process_raises_its_own_problem():
    agree("f", SIG, None)  # torch.distributed is not initialised: one process, nothing to compare
    with pytest.raises(TypeError, match=r"^f: bad q$"):
        agree("f", SIG, None, problem=(TypeError, "bad q"))
    with pytest.raises(ValueError, match=r"^nope$"):
        agree("", (), None, problem="nope")

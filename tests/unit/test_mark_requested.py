"""The one reading of "this run asks for the slow (or timed) tests" (tests/conftest.py): what -m selects."""
from __future__ import annotations

import pytest

from tests.conftest import mark_requested


class _Config:
    def __init__(self, markexpr: str) -> None:
        self.markexpr = markexpr

    def getoption(self, name: str):
        assert name == "markexpr"
        return self.markexpr


@pytest.mark.parametrize("markexpr,slow,timed", [
    ("", False, False), ("slow", True, False), ("timed", False, True), ("slow or timed", True, True),
    ("not slow", False, False),  # a substring test read this as a request for the slow cases
    ("not cuda", False, False),  # selects unmarked tests too: the core cases, as without -m
    ("slow and not cuda", True, False)])
def test_mark_requested_reads_the_marker_expression(markexpr, slow, timed):
    assert mark_requested(_Config(markexpr), "slow") is slow
    assert mark_requested(_Config(markexpr), "timed") is timed

"""Session-wide local process groups: one :class:`~burstattn.testing.launch.LocalPool` per world size.

Starting ranks costs seconds (spawn + import torch), a case costs milliseconds, so every
multi-process test runs its cases inside these shared pools: ``pools.get(world_size)``
starts the pool on first use; all pools close at the end of the session.
"""
from __future__ import annotations

import pytest
from _pytest.mark.expression import Expression  # pytest's own -m parser

from burstattn.testing.launch import LocalPool

POOL_TIMEOUT_S = 300.0  # one case, all ranks
PG_TIMEOUT_S = 30.0  # one collective: a hung ring errors instead of stalling the suite


class Pools:
    """Lazily started pools by world size."""

    def __init__(self) -> None:
        self._pools: dict[int, LocalPool] = {}

    def get(self, world_size: int, threads: int = 1) -> LocalPool:
        """The pool of ``world_size`` ranks (1 thread each: the only kind the session keeps; ``threads``
        is there for callers written against :class:`bench.driver.Pools`)."""
        assert threads == 1, "the session pools run one thread per rank"
        pool = self._pools.get(world_size)
        if pool is None:
            pool = LocalPool(world_size, backend="gloo", threads_per_rank=1,
                             timeout_s=POOL_TIMEOUT_S, pg_timeout_s=PG_TIMEOUT_S)
            self._pools[world_size] = pool
        return pool

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


def mark_requested(config, name: str) -> bool:
    """Whether this run asks for the tests marked ``name`` (``-m slow``, ``-m "slow or timed"``): its marker
    expression selects a test with that mark alone and would not select an unmarked test. ``-m "not cuda"``
    selects both and ``-m "not slow"`` neither: no request; nor is a run without ``-m``."""
    text = config.getoption("markexpr") or ""
    if not text:
        return False
    expr = Expression.compile(text)
    return expr.evaluate(lambda mark, **_: mark == name) and not expr.evaluate(lambda mark, **_: False)


@pytest.fixture(scope="session")
def slow_selected(pytestconfig) -> bool:
    """Whether this run asks for the ``slow`` cases (:func:`mark_requested`): the one reading of it, for the
    tests that run their core cases always and their longer ones (or a whole long test) only with -m slow."""
    return mark_requested(pytestconfig, "slow")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``timed`` assert a time bound: they run only when selected (``-m timed``), since a
    noisy shared machine makes any time bound flaky; everything else asserts counts, bytes or values."""
    if mark_requested(config, "timed"):
        return
    skip = pytest.mark.skip(reason="asserts a time bound: run with -m timed on a quiet machine")
    for item in items:
        if "timed" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def pools():
    registry = Pools()
    yield registry
    registry.close()


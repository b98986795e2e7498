"""burstattn.testing.launch: results in rank order, errors with tracebacks, nothing left behind,
and a pool that survives clean failures and tears itself down on hangs and deaths."""
from __future__ import annotations

import multiprocessing
import os
import time

import pytest
import torch
import torch.distributed as dist

from burstattn.testing.launch import LocalGroupError, LocalPool, run_local


def _info(rank, world, offset):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return rank + offset, world, t.item(), torch.get_num_threads(), dist.get_backend(), os.getpid()


def _raise_on(rank, world, bad_rank):
    if rank == bad_rank:
        raise KeyError(f"deliberate failure on rank {rank}")
    return rank


def _raise_then_others_hang(rank, world):
    if rank == 0:
        raise ValueError("rank 0 leaves before the collective")
    dist.all_reduce(torch.ones(1))  # never completes: rank 0 is not there
    return rank


def _die(rank, world):
    if rank == world - 1:
        os._exit(5)
    dist.barrier()
    return rank


def test_run_local_rank_order_threads_and_cleanup():
    before = set(multiprocessing.active_children())  # the session's pools may be running
    results = run_local(_info, 3, 10, threads_per_rank=2)
    assert [r[0] for r in results] == [10, 11, 12]
    assert all(r[1] == 3 and r[2] == 3.0 and r[3] == 2 and r[4] == "gloo" for r in results)
    assert len({r[5] for r in results}) == 3
    with pytest.raises(LocalGroupError) as info:
        run_local(_raise_on, 2, 1)
    err = info.value
    assert set(err.errors) == {1} and err.results == {0: 0}
    assert "KeyError" in str(err) and "deliberate failure on rank 1" in str(err) and "_raise_on" in str(err)
    assert set(multiprocessing.active_children()) == before
    for pid in {r[5] for r in results}:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_pool_survives_clean_failures_and_recovers_from_hangs_and_deaths():
    before = set(multiprocessing.active_children())
    with LocalPool(2, pg_timeout_s=3.0, timeout_s=60.0) as pool:
        pids = {r[5] for r in pool.run(_info, 0)}
        with pytest.raises(LocalGroupError, match="deliberate"):
            pool.run(_raise_on, 0)
        assert [r[0] for r in pool.run(_info, 0)] == [0, 1]

        with pytest.raises(LocalGroupError) as info:
            pool.run(_raise_then_others_hang)
        assert "ValueError" in info.value.errors[0].type_names
        # the collective's own timeout (pg_timeout_s) fired, not the pool's: a hang would end there
        assert "RuntimeError" in info.value.errors[1].type_names
        assert {r[5] for r in pool.run(_info, 0)} == pids  # same processes, fresh group

        with pytest.raises(LocalGroupError, match="exited with code 5"):
            pool.run(_die)
        assert not pool.alive
        assert [r[0] for r in pool.run(_info, 0)] == [0, 1]  # restarted on demand
    assert not pool.alive and set(multiprocessing.active_children()) == before

"""Rank-side functions of tests/dist/test_agree.py: burstattn.comm.agree over a real group. Each returns
``(exception type name, message)`` or ``("no error", "")``."""
from __future__ import annotations

import torch.distributed as dist


def exchange(rank: int, world: int, kind: str) -> tuple[str, str]:
    """One :func:`agree` call in which ``kind`` differs: ``same``, ``value`` (the last rank's seed),
    ``alone`` (the function and a shape differ), ``problem`` (rank 1's own), ``problems`` (TypeError on
    rank 1, ValueError on the last rank), ``every`` (the same problem on every rank)."""
    from burstattn.comm.agree import agree, entries
    from burstattn.comm.stats import CommStats

    sig = {"function": "f", "seed": 1, "heads": 4}
    problem = None
    if kind == "value" and rank == world - 1:
        sig["seed"] = 2
    if kind == "alone" and rank == 0:
        sig.update(function="g", heads=8)
    if kind == "problem" and rank == 1:
        problem = "q must be 4-D"
    if kind == "problems" and rank in (1, world - 1):
        problem = (TypeError, f"bad dtype {rank}") if rank == 1 else (ValueError, "bad shape")
    if kind == "every":
        problem = "bad everywhere"
    try:
        stats = CommStats()
        agree("check", entries(sig), dist.group.WORLD, problem=problem, alone=("function",), stats=stats)
    except Exception as e:  # noqa: BLE001 - the type is the result
        return type(e).__name__, str(e)
    return "no error", str(stats.sent("forward", "meta"))


def train_flags(rank: int, world: int, field: str, values: list) -> tuple[str, str]:
    """``build_job`` on a TrainConfig whose ``field`` is ``values[rank]`` on this rank (what flags that
    differ between launched ranks give)."""
    from burstattn.train import TrainConfig, build_job

    try:
        build_job(TrainConfig(model="tiny", seq_len=120, batch=2, steps=1, **{field: values[rank]}))
    except Exception as e:  # noqa: BLE001 - the type is the result
        return type(e).__name__, str(e)
    return "no error", ""

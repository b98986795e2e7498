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


def _qkv(n: int, seed: int = 3):
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, n, 2, 8, generator=g, dtype=torch.float64) for _ in range(3)]


def site(rank: int, world: int, name: str) -> tuple[str, str]:
    """One library check that compares across ranks, called with an input that is wrong on one rank (or
    differs on the last rank): ``(exception type name, message)`` or ``("no error", "")``."""
    import torch

    import burstattn
    from burstattn import recurrent as rec
    from burstattn.comm.groups import group_context
    from burstattn.infer.generate import generate
    from burstattn.masks.setup import GuardedMaskMod, raise_mask_failures
    from burstattn.train.dispatch_step import check_same_batch

    last = rank == world - 1
    world_group = dist.group.WORLD
    try:
        if name == "attention_shapes":  # the last rank's shard is longer
            q, k, v = _qkv(6 if last else 4)
            burstattn.burst_attn_func(q, k, v, causal=True, backend="reference", layout="contiguous")
        elif name == "attention_problem":  # rank 1's q is 3-D
            q, k, v = _qkv(4)
            burstattn.burst_attn_func(q[0] if rank == 1 else q, k, v, causal=True, backend="reference")
        elif name == "attention_strategy":  # the last rank calls another strategy
            q, k, v = _qkv(4)
            burstattn.attention(q, k, v, strategy="ring" if last else "burst", causal=True)
        elif name == "delta_rule":  # the last rank's chunk size differs
            g = torch.Generator().manual_seed(5)
            q, k, v = (torch.randn(1, 4, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
            gate = -torch.rand(1, 4, 2, generator=g, dtype=torch.float64)
            beta = torch.rand(1, 4, 2, generator=g, dtype=torch.float64)
            rec.sp_gated_delta_rule(q, k, v, gate, beta, chunk_size=4 if last else 2)
        elif name == "conv":  # the last rank's convolution is wider
            x = torch.randn(1, 4, 3, dtype=torch.float64)
            rec.sp_causal_conv1d(x, torch.randn(3, 5 if last else 4, dtype=torch.float64))
        elif name == "generate":  # the last rank's prompt differs in one token
            from tests.dist.infer_cases import tiny_model

            prompt = torch.arange(8).view(1, 8)
            generate(tiny_model(0), prompt + int(last), 2, backend="reference", group=world_group)
        elif name == "dispatch":  # the last rank's global batch has another length
            check_same_batch([5, 7, 9 + int(last)], world_group)
        elif name == "mask_mod":  # the predicate failed on rank 1 during the pass
            guard = GuardedMaskMod(lambda q, k: q >= k)
            guard.failure = "mask_mod raised IndexError: out of range" if rank == 1 else None
            raise_mask_failures(guard, group_context(world_group))
        elif name == "hf_batch":  # the last rank's full batch differs
            from burstattn.hf.batch import checked_plan

            ids = torch.arange(16).view(2, 8) + int(last)
            checked_plan("shard_batch", ids, group=world_group)
        elif name == "hf_cache":  # the last rank fed other tokens
            from burstattn.hf import ShardedCache

            keys = torch.ones(1, 2, 3, 4) * (2.0 if last else 1.0)
            ShardedCache(world_group)._check_same_tokens(keys)
        else:
            raise KeyError(name)
    except Exception as e:  # noqa: BLE001 - the type is the result
        return type(e).__name__, str(e)
    return "no error", ""

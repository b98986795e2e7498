"""Rank functions of the simulator's checks against the library (picklable, module level)."""
from __future__ import annotations

import time

import torch


def attention_peak(rank: int, world: int, strategy: str, n: int, hq: int, hkv: int, d: int, causal: bool,
                   options: dict, repeats: int = 0) -> dict:
    """Peak bytes of one fwd+bwd of ``strategy`` on this rank (inputs existing before: q, k, v and
    dO), and the fastest fwd / fwd+bwd seconds of ``repeats`` timed calls."""
    from burstattn.bench.memory import measure_peak
    from burstattn.strategies import attention

    gen = torch.Generator().manual_seed(rank)
    q = torch.randn(1, n, hq, d, generator=gen).requires_grad_()
    k, v = (torch.randn(1, n, hkv, d, generator=gen).requires_grad_() for _ in "kv")
    grad = torch.randn(1, n, hq, d, generator=gen)

    def fwd_bwd():
        attention(q, k, v, strategy=strategy, causal=causal, **options).backward(grad)
        q.grad = k.grad = v.grad = None

    fwd_bwd()
    _, peak = measure_peak(fwd_bwd)
    times = {"fwd": [], "fwd+bwd": []}
    for _ in range(repeats):
        torch.distributed.barrier()
        t0 = time.perf_counter()
        with torch.no_grad():
            attention(q, k, v, strategy=strategy, causal=causal, **options)
        torch.distributed.barrier()
        t1 = time.perf_counter()
        fwd_bwd()
        torch.distributed.barrier()
        times["fwd"].append(t1 - t0)
        times["fwd+bwd"].append(time.perf_counter() - t1)
    fastest = {k: min(v) for k, v in times.items() if v}  # other processes only ever slow a repeat down
    return {"peak": peak.peak_bytes, "times": fastest}


"""Rank functions of the simulator's checks against the library (picklable, module level)."""
from __future__ import annotations

import time

import torch


def attention_peak(rank: int, world: int, strategy: str, n: int, hq: int, hkv: int, d: int, causal: bool,
                   options: dict, repeats: int = 0, memory_repeats: int = 1) -> dict:
    """Peak bytes of one fwd+bwd of ``strategy`` on this rank (inputs existing before: q, k, v and
    dO): ``peak`` the smallest of ``memory_repeats`` measurements, ``peak_max`` the largest; ``buffers``
    the bytes of the call's collective inputs (bounded above by the bytes sent x P / (P - 1): an
    all-to-all sends (P-1)/P of its input, a gather P-1 times it); and the fastest fwd / fwd+bwd
    seconds of ``repeats`` timed calls."""
    import burstattn
    from burstattn.meter.memory import measure_peak
    from burstattn.strategies import attention

    gen = torch.Generator().manual_seed(rank)
    q = torch.randn(1, n, hq, d, generator=gen).requires_grad_()
    k, v = (torch.randn(1, n, hkv, d, generator=gen).requires_grad_() for _ in "kv")
    grad = torch.randn(1, n, hq, d, generator=gen)

    def fwd_bwd():
        attention(q, k, v, strategy=strategy, causal=causal, **options).backward(grad)
        q.grad = k.grad = v.grad = None

    with burstattn.comm_stats() as stats:
        fwd_bwd()
    peaks = [measure_peak(fwd_bwd)[1].peak_bytes for _ in range(memory_repeats)]
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
    buffers = stats.sent() * world / max(world - 1, 1)
    return {"peak": min(peaks), "peak_max": max(peaks), "buffers": buffers, "times": fastest}


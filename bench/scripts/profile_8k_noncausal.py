"""burst against ring at issue 32's point (P=2, N=8,192, non-causal, float32, 8 heads, d 64, zigzag): each
rank's thread CPU seconds of fwd+bwd (alternating, 5 repeats, median) and ``torch.profiler``'s op table of one
fwd+bwd on rank 0 (bench/results/grid.md, "The grid again on today's engine").

    python -m bench.scripts.profile_8k_noncausal
"""
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")  # the repository root)
import burstattn
from burstattn.testing.launch import run_local

def work(rank, world, n=8192, repeats=5):
    torch.manual_seed(0)
    full = [torch.randn(1, n, 8, 64) for _ in range(4)]
    sh = lambda x: burstattn.shard_sequence(x, layout="zigzag")
    q, k, v, do = (sh(x).contiguous() for x in full)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    def call(strat):
        q.grad = k.grad = v.grad = None
        t0 = time.thread_time(); w0 = time.perf_counter()
        out = burstattn.attention(q, k, v, strategy=strat, causal=False, layout="zigzag")
        t1 = time.thread_time()
        out.backward(do)
        dist.barrier()
        return time.thread_time() - t0, t1 - t0, time.perf_counter() - w0
    res = {"burst": [], "ring": []}
    for s in ("burst", "ring"): call(s)
    for i in range(repeats):
        for s in (("burst", "ring") if i % 2 == 0 else ("ring", "burst")):
            res[s].append(call(s))
    prof = {}
    from torch.profiler import profile, ProfilerActivity
    for s in ("burst", "ring"):
        with profile(activities=[ProfilerActivity.CPU]) as p:
            call(s)
        prof[s] = p.key_averages().table(sort_by="self_cpu_time_total", row_limit=18)
    return res, prof

if __name__ == "__main__":
    out = run_local(work, 2, threads_per_rank=1, timeout_s=1800)
    for r, (res, prof) in enumerate(out):
        for s, xs in res.items():
            xs = sorted(xs)
            m = xs[len(xs)//2]
            print(f"rank {r} {s}: thread fwd+bwd {m[0]:.3f}s fwd {m[1]:.3f}s wall {m[2]:.3f}s  all thread {[round(x[0],3) for x in res[s]]}")
    for s in ("burst", "ring"):
        print("=====", s, "rank 0"); print(out[0][1][s])

"""burst at 8K and 16K (P=2, 8 heads, d 64, float32, zigzag; issue 32): the engine's default head groups
against one group (``MIN_GROUP_ELEMENTS`` raised). Thread CPU s of fwd+bwd per rank, alternating, median of 7
(bench/results/grid.md, "The 8K points again").

    python -m bench.scripts.head_groups_time
"""
import os
import sys
import time

import torch
import torch.distributed as dist
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")  # the repository root)
import burstattn
import burstattn.engine.run as er
from burstattn.testing.launch import run_local

def work(rank, world, n, causal, repeats=7):
    torch.manual_seed(0)
    full = [torch.randn(1, n, 8, 64) for _ in range(4)]
    sh = lambda x: burstattn.shard_sequence(x, layout="zigzag")
    q, k, v, do = (sh(x).contiguous() for x in full)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    default = er.MIN_GROUP_ELEMENTS
    def call(mode):
        er.MIN_GROUP_ELEMENTS = default if mode == "groups" else 1 << 40
        q.grad = k.grad = v.grad = None
        dist.barrier()
        t0 = time.thread_time(); w0 = time.perf_counter()
        out = burstattn.attention(q, k, v, strategy="burst", causal=causal, layout="zigzag")
        out.backward(do)
        t = time.thread_time() - t0
        dist.barrier()
        return t, time.perf_counter() - w0
    res = {"groups": [], "one": []}
    for m in res: call(m)
    for i in range(repeats):
        for m in (("groups", "one") if i % 2 == 0 else ("one", "groups")):
            res[m].append(call(m))
    er.MIN_GROUP_ELEMENTS = default
    return {m: sorted(x)[len(x)//2] for m, x in res.items()}

if __name__ == "__main__":
    for n, causal in ((8192, False), (8192, True), (16384, False)):
        out = run_local(work, 2, n, causal, threads_per_rank=1, timeout_s=1800)
        for r, res in enumerate(out):
            print(n, "causal" if causal else "full", "rank", r, {m: (round(t, 3), round(w, 3)) for m, (t, w) in res.items()},
                  "one/groups thread", round(res["one"][0] / res["groups"][0], 3))

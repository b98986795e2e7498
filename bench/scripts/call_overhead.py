"""Per-call CPU time of ``burst_attn_func`` at a world of one on a tiny shape, where the call path's Python
work (build and check the call, cross the op, plan) is most of the time: the quantity issue 28 halves.

Prints one JSON line: the median thread CPU time (``time.thread_time``, so other processes' load does not
count) per forward+backward call, over ``--calls`` calls after ``--warmup``. Run it once per code version,
alternating (``PYTHONPATH`` picks the version), and compare medians::

    for i in 1 2 3; do for tree in /tmp/before /work/wt/house; do
        PYTHONPATH=$tree python -m bench.scripts.call_overhead --label $tree; done; done
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    torch.set_num_threads(1)
    import burstattn

    q, k, v = (torch.randn(1, args.seq_len, args.heads, args.head_dim, requires_grad=True) for _ in range(3))
    times = {"dense": [], "window": []}
    module = burstattn.BurstAttention(causal=True, window=(64, 0))
    for i in range(args.warmup + args.calls):
        for kind in times:
            t0 = time.thread_time()
            out = burstattn.burst_attn_func(q, k, v, causal=True) if kind == "dense" else module(q, k, v)
            out.sum().backward()
            if i >= args.warmup:
                times[kind].append(time.thread_time() - t0)
    print(json.dumps({"label": args.label, "seq_len": args.seq_len, "heads": args.heads, "head_dim": args.head_dim,
                      "calls": args.calls,
                      **{f"{kind}_median_us": round(statistics.median(t) * 1e6, 1) for kind, t in times.items()}}))


if __name__ == "__main__":
    main()

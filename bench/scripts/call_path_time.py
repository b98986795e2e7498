"""World-one forward time of a dense ``burst_attn_func`` call at a small shape (256 tokens), where the call
path's Python work (keywords, the Call, its checks, the op boundary) is most of the time: the median
thread CPU time (``time.thread_time``: other processes' load does not count) per forward, over ``--calls``
calls after ``--warmup``, one thread.

Compare code versions side by side: each tree runs in its own subprocess (``PYTHONPATH`` picks it), the
trees alternate for ``--rounds`` rounds, and the median of the rounds' medians is reported per tree::

    python -m bench.scripts.call_path_time --trees /tmp/before . --labels before after
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def measure(seq_len: int, heads: int, head_dim: int, calls: int, warmup: int) -> dict:
    """``{"forward_median_us", "kernel_median_us", "overhead_median_us"}``: the library's forward, the local
    kernel alone (the one the library's world-one dense call runs) and their difference, call by call."""
    import torch

    import burstattn
    from burstattn.kernels import get_kernel

    torch.set_num_threads(1)
    q, k, v = (torch.randn(1, seq_len, heads, head_dim) for _ in range(3))
    kernel = get_kernel("cpu_flash")
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
    times: dict = {"forward": [], "kernel": [], "overhead": []}
    for i in range(warmup + calls):
        t0 = time.thread_time()
        burstattn.burst_attn_func(q, k, v, causal=True)
        t1 = time.thread_time()
        kernel.forward(qh, kh, vh, head_dim ** -0.5, True)
        t2 = time.thread_time()
        if i >= warmup:
            times["forward"].append(t1 - t0)
            times["kernel"].append(t2 - t1)
            times["overhead"].append((t1 - t0) - (t2 - t1))
    return {f"{name}_median_us": round(statistics.median(t) * 1e6, 1) for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trees", nargs="*", default=[])
    ap.add_argument("--labels", nargs="*", default=[])
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    shape = (args.seq_len, args.heads, args.head_dim, args.calls, args.warmup)
    if not args.trees:
        print(json.dumps(measure(*shape)))
        return
    runs: dict = {}
    for _ in range(args.rounds):
        for i, tree in enumerate(args.trees):
            label = args.labels[i] if i < len(args.labels) else tree
            env = {**os.environ, "PYTHONPATH": os.path.abspath(tree), "OMP_NUM_THREADS": "1"}
            # this file run as a script: burstattn comes from PYTHONPATH (the tree), not from this checkout
            cmd = [sys.executable, os.path.abspath(__file__), "--seq-len", str(args.seq_len), "--heads",
                   str(args.heads), "--head-dim", str(args.head_dim), "--calls", str(args.calls), "--warmup",
                   str(args.warmup)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, cwd=os.path.abspath(tree))
            runs.setdefault(label, []).append(json.loads(out.stdout.strip().splitlines()[-1]))
    summary = {label: {key: statistics.median(r[key] for r in rs) for key in rs[0]} | {"rounds": rs}
               for label, rs in runs.items()}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

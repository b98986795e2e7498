"""Python function calls made before the engine in one dense ``burst_attn_func`` forward at a world of one,
counted with ``sys.setprofile`` (every Python frame entered, the library's and torch's op machinery alike),
and how many of them the op boundary makes (``burstattn/call/boundary.py`` and what it calls). Counting
starts at the call and stops when the strategy's ``forward`` (the engine side) is entered; the call is
repeated first, so memos are warm, as in a model's every layer after the first.

Compare code versions side by side (each tree in its own subprocess, ``PYTHONPATH`` picks it)::

    python -m bench.scripts.call_count --trees /tmp/before . --labels before after
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def count(seq_len: int, heads: int, head_dim: int) -> dict:
    """``{"calls", "library_calls", "boundary_calls"}`` of one forward (this process's ``burstattn``)."""
    import torch

    import burstattn

    torch.set_num_threads(1)
    q, k, v = (torch.randn(1, seq_len, heads, head_dim) for _ in range(3))
    for _ in range(5):
        burstattn.burst_attn_func(q, k, v, causal=True)
    totals = {"calls": 0, "library_calls": 0, "boundary_calls": 0}
    state = {"done": False}
    sep = os.sep

    def profile(frame, event, arg):
        if event != "call" or state["done"]:
            return
        code = frame.f_code
        if code.co_name == "forward" and code.co_filename.endswith(f"strategies{sep}burst.py"):
            state["done"] = True  # the engine side starts here
            return
        totals["calls"] += 1
        if f"burstattn{sep}" in code.co_filename:
            totals["library_calls"] += 1
        f = frame
        while f is not None:
            if f.f_code.co_filename.endswith(f"call{sep}boundary.py"):
                totals["boundary_calls"] += 1
                break
            f = f.f_back

    sys.setprofile(profile)
    try:
        burstattn.burst_attn_func(q, k, v, causal=True)
    finally:
        sys.setprofile(None)
    return totals


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trees", nargs="*", default=[], help="source trees to compare (default: this process's)")
    ap.add_argument("--labels", nargs="*", default=[])
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    args = ap.parse_args()
    if not args.trees:
        print(json.dumps(count(args.seq_len, args.heads, args.head_dim)))
        return
    results = {}
    for i, tree in enumerate(args.trees):
        label = args.labels[i] if i < len(args.labels) else tree
        env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
        # this file run as a script: burstattn comes from PYTHONPATH (the tree), not from this checkout
        cmd = [sys.executable, os.path.abspath(__file__), "--seq-len", str(args.seq_len), "--heads", str(args.heads),
               "--head-dim", str(args.head_dim)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, cwd=os.path.abspath(tree))
        results[label] = json.loads(out.stdout.strip().splitlines()[-1])
    print(json.dumps(results))


if __name__ == "__main__":
    main()

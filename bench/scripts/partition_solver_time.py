"""mask_partition's solver time at the issue's size: 1M tokens over 1,024 ranks in tiles of 256, causal
(plain, window N/32, window N/8); CPU seconds of this thread (``time.thread_time``), median of ``--repeats``.

    python -m bench.scripts.partition_solver_time [--repeats 3]
"""
from __future__ import annotations

import argparse
import statistics
import time

from burstattn.masks import AttnMask
from burstattn.masks.partition_solver import solve_partition


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    ns = p.parse_args()
    n, world = 1 << 20, 1024
    for name, window in (("causal", None), ("window N/32", (n // 32, 0)), ("window N/8", (n // 8, 0))):
        times = []
        for _ in range(ns.repeats):
            mask = AttnMask(block_size=256, window=window)  # a new mask: no cached solution
            t = time.thread_time()
            sol = solve_partition(mask, n, world, causal=True)
            times.append(time.thread_time() - t)
        print(f"{name}: {statistics.median(times):.2f} s (median of {ns.repeats}), kept {sol.candidate}, "
              f"max/mean {sol.balance:.3f}, touching pairs {sol.pairs}")


if __name__ == "__main__":
    main()

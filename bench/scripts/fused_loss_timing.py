"""Side by side, one process: the step with the fused blockwise loss against the unfused blockwise
loss and the unchunked step (small-l3, float32, world 1), with and without checkpointing. Arms
alternate step by step; each arm's median of the step's thread CPU time (one thread). Prints a JSON
record. Usage: python -m bench.scripts.fused_loss_timing [--seq-lens 1024 8192] [--repeats 7]"""
from __future__ import annotations

import argparse
import json
import statistics
import time


def measure(rank: int, world: int, seq_lens: list, repeats: int) -> dict:
    import torch

    from bench.train_memory import build
    from burstattn.train.dryrun import warm_optimizer
    from burstattn.train import TrainConfig, train_step

    torch.set_num_threads(1)
    out = {}
    for n in seq_lens:
        for ck in ("none", "remat"):
            base = TrainConfig(model="small-l3", seq_len=n, batch=1, steps=100, lr=1e-4, warmup=0, checkpointing=ck,
                               mlp_chunk=0, loss_chunk=0)
            arms = {"unchunked": base, "blockwise loss": base.with_overrides(loss_chunk=256),
                    "fused loss": base.with_overrides(loss_chunk=256, fused_loss=True)}
            if ck == "remat":
                arms["blockwise mlp + fused loss"] = base.with_overrides(mlp_chunk=256, loss_chunk=256, fused_loss=True)
            jobs = {k: build(c) for k, c in arms.items()}
            for j in jobs.values():
                warm_optimizer(j)
            times = {k: [] for k in jobs}
            for i in range(repeats):
                for k, j in jobs.items():
                    t0 = time.thread_time()
                    train_step(j, 2 + i)
                    times[k].append(time.thread_time() - t0)
            med = {k: statistics.median(v) for k, v in times.items()}
            out[f"{n}/{ck}"] = {"median_s": med, "x_unchunked": {k: v / med["unchunked"] for k, v in med.items()}}
    return out


def main() -> None:
    from burstattn.testing.launch import run_local

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--repeats", type=int, default=7)
    ns = ap.parse_args()
    print(json.dumps(run_local(measure, 1, ns.seq_lens, ns.repeats, timeout_s=3600.0)[0], indent=1))


if __name__ == "__main__":
    main()

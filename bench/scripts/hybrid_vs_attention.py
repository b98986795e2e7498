"""hybrid-small against the same-size full-attention model (``small``: dim 256, 4 layers, 4 heads, ffn 688,
vocabulary 256) at world 2, side by side in one run: training steps of the two models alternate (after one
warm-up step each), and each rank reports the CPU seconds of its own threads per step (``time.thread_time``:
the ranks share 2 cores, so the wall clock counts the other rank too) and the allocator's peak of a step.

    python -m bench.scripts.hybrid_vs_attention --seq-len 4096 --steps 7 [--json OUT]

Prints the median per model and the ratio; ``--json`` writes them."""
from __future__ import annotations

import argparse
import json
import statistics
import time


def _arm(rank: int, world: int, seq_len: int, steps: int, strategy: str) -> dict:
    import torch.distributed as dist

    from bench.train_memory import probe_step
    from burstattn.train import TrainConfig, build_job, train_step

    cfgs = {m: TrainConfig(model=m, seq_len=seq_len, batch=1, steps=steps + 1, lr=1e-4, warmup=0, strategy=strategy,
                           checkpointing="remat", mlp_chunk=512, loss_chunk=256) for m in ("hybrid-small", "small")}
    jobs = {m: build_job(c) for m, c in cfgs.items()}
    cpu = {m: [] for m in jobs}
    for m, job in jobs.items():
        train_step(job, 0)  # warm-up
    for s in range(1, steps + 1):
        for m, job in jobs.items():  # alternating arms
            dist.barrier()
            t = time.thread_time()
            train_step(job, s)
            cpu[m].append(time.thread_time() - t)
    peaks = {m: probe_step(rank, world, c)["peak_bytes"] for m, c in cfgs.items()}
    return {"cpu_s": cpu, "peak_bytes": peaks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--strategy", default="burst")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from burstattn.testing.launch import run_local

    ranks = run_local(_arm, 2, a.seq_len, a.steps, a.strategy, threads_per_rank=1, timeout_s=3600.0)
    out = {"seq_len": a.seq_len, "world": 2, "strategy": a.strategy, "steps": a.steps, "models": {}}
    for m in ("hybrid-small", "small"):
        slowest = [max(r["cpu_s"][m][i] for r in ranks) for i in range(a.steps)]
        med = statistics.median(slowest)
        out["models"][m] = {"median_slowest_rank_cpu_s": med, "tokens_per_cpu_s": a.seq_len / med,
                            "peak_bytes": max(r["peak_bytes"][m] for r in ranks)}
    h, s = out["models"]["hybrid-small"], out["models"]["small"]
    out["time_ratio_hybrid_over_attention"] = h["median_slowest_rank_cpu_s"] / s["median_slowest_rank_cpu_s"]
    out["peak_ratio_hybrid_over_attention"] = h["peak_bytes"] / s["peak_bytes"]
    print(json.dumps(out, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

"""The dry run against a real CUDA allocation (issue 27's device point; run on a GPU, world 1).

For each configuration: ``burstattn train --dry-run``'s peak (fake CPU tensors in the GPU's dtype, the
flash-attn 2 workspace added by formula) beside one steady-state step run for real on the GPU
(:func:`bench.train_memory.probe_step`: ``torch.cuda.max_memory_allocated`` above what exists
before the step), and ``torch.cuda.max_memory_reserved`` (the caching allocator's own rounding and
fragmentation, which the planner's 10% headroom stands for).

    python scripts/cuda_dryrun_check.py --out cuda_dryrun.json [--cases small]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from burstattn.train import TrainConfig  # noqa: E402

SMALL = TrainConfig(model="small-l3", seq_len=32768, batch=1, steps=10, lr=1e-4, warmup=0, dtype="bfloat16")
CASES = {
    "small": [
        (SMALL, dict(checkpointing="none", mlp_chunk=0, loss_chunk=0)),
        (SMALL, dict(checkpointing="remat", mlp_chunk=4096, loss_chunk=1024)),
        (SMALL, dict(checkpointing="full", mlp_chunk=4096, loss_chunk=1024)),
        (SMALL, dict(seq_len=131072, checkpointing="remat", mlp_chunk=4096, loss_chunk=1024)),
    ],
    "large": [
        (SMALL, dict(model="llama3-8b", seq_len=8192, checkpointing="remat", mlp_chunk=4096, loss_chunk=1024)),
    ],
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="cuda_dryrun.json")
    ap.add_argument("--cases", default="small,large")
    args = ap.parse_args()
    from bench.train_memory import probe_step
    from burstattn.train.dryrun import dry_run

    cfgs = [base.with_overrides(**o) for name in args.cases.split(",") for base, o in CASES[name]]
    rows = []
    for cfg in cfgs:  # the dry runs first: they bring their own (fake) process group
        t0 = time.perf_counter()
        try:
            rep = dry_run(cfg, 1, 0)
            rows.append(dict(config=dataclasses.asdict(cfg), dry_peak_bytes=rep["peak_bytes"],
                             dry_step_peak_bytes=rep["step_peak_bytes"], dry_start_bytes=rep["start_bytes"],
                             dry_workspace_bytes=rep["workspace_bytes"], dry_by_category=rep["peak_by_category"],
                             dry_seconds=time.perf_counter() - t0))
        except Exception as exc:  # noqa: BLE001 - recorded, the next case runs
            rows.append(dict(config=dataclasses.asdict(cfg), dry_error=f"{type(exc).__name__}: {exc}"[:500]))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "config"}), flush=True)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    for cfg, row in zip(cfgs, rows):
        try:
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            real = probe_step(0, 1, cfg)
            row.update(real_peak_bytes=real["peak_bytes"], real_seconds=time.perf_counter() - t0, loss=real["loss"],
                       max_reserved_bytes=torch.cuda.max_memory_reserved() if cuda else None,
                       max_allocated_bytes=torch.cuda.max_memory_allocated() if cuda else None)
            if "dry_step_peak_bytes" in row:
                row["step_error"] = row["dry_step_peak_bytes"] / real["peak_bytes"] - 1
                if cuda:
                    row["total_error"] = row["dry_peak_bytes"] / row["max_allocated_bytes"] - 1
                    row["reserved_over_allocated"] = row["max_reserved_bytes"] / row["max_allocated_bytes"] - 1
        except Exception as exc:  # noqa: BLE001
            row["real_error"] = f"{type(exc).__name__}: {exc}"[:500]
            traceback.print_exc()
        print(json.dumps({k: v for k, v in row.items() if k != "config"}), flush=True)
    dist.destroy_process_group()
    with open(args.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__, rows=rows),
                  f, indent=1, default=str)


if __name__ == "__main__":
    main()

"""Where a CUDA step's memory peak differs from the dry run's (run on a GPU, world 1).

1. The attention call alone (``burst_attn_func`` forward + backward at world 1, inputs allocated first):
   its peak above the inputs, per kernel the ``sdpa`` backend picks (cuDNN, flash), for small-l3's and
   llama3-8b's head shapes. Run on CPU it gives the CPU flash op's figure to set beside them.
2. One training step under ``torch.cuda.memory._record_memory_history``: the blocks alive at the
   allocator's peak, grouped by the innermost burstattn frame that allocated them.

    python scripts/cuda_mem_diag.py --out cuda_mem_diag.json [--seq-len 32768]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections import Counter

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import burstattn  # noqa: E402
from burstattn.train import TrainConfig  # noqa: E402

SHAPES = {"small-l3": (4, 1, 64), "llama3-8b": (32, 8, 128)}


def attention_peak(n: int, hq: int, hkv: int, d: int, device, prefer_cudnn: bool) -> dict:
    from burstattn.meter.memory import measure_peak
    from burstattn.kernels import sdpa

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, n, hq, d, generator=gen).to(device, torch.bfloat16).requires_grad_()
    k, v = (torch.randn(1, n, hkv, d, generator=gen).to(device, torch.bfloat16).requires_grad_() for _ in "kv")
    do = torch.randn(1, n, hq, d, generator=gen).to(device, torch.bfloat16)
    old = sdpa.SdpaKernel.__init__.__defaults__
    sdpa.SdpaKernel.__init__.__defaults__ = (prefer_cudnn,)
    try:
        def step():
            burstattn.burst_attn_func(q, k, v, causal=True).backward(do)
            q.grad = k.grad = v.grad = None
        step()
        _, peak = measure_peak(step, device=device)
    finally:
        sdpa.SdpaKernel.__init__.__defaults__ = old
    qbytes = q.numel() * 2
    return dict(n=n, hq=hq, hkv=hkv, d=d, cudnn=prefer_cudnn, peak_bytes=peak.peak_bytes,
                peak_in_q_shards=peak.peak_bytes / qbytes, q_bytes=qbytes)


def frame_of(frames: list) -> str:
    for f in frames:
        name = f.get("filename", "")
        if "burstattn" in name:
            return f"{name.split('burstattn')[-1]}:{f.get('line')}:{f.get('name')}"
    return "other"


def step_peak_blocks(cfg: TrainConfig) -> dict:
    from bench.train_memory import build, warm_optimizer
    from burstattn.train import train_step

    job = build(cfg, "lean")
    warm_optimizer(job)
    train_step(job, 1)
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=200000)
    torch.cuda.reset_peak_memory_stats()
    train_step(job, 2)
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    live, best, at_best, cur = {}, 0, {}, 0
    for ev in snap["device_traces"][0]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = (ev["size"], frame_of(ev.get("frames", [])))
            cur += ev["size"]
        elif ev["action"] in ("free_completed",) and ev["addr"] in live:
            cur -= live.pop(ev["addr"])[0]
        if cur > best:
            best, at_best = cur, dict(live)
    groups = Counter()
    for size, where in at_best.values():
        groups[where] += size
    return dict(config=dataclasses.asdict(cfg), traced_peak_above_start=best, max_allocated=torch.cuda.max_memory_allocated(),
                groups=groups.most_common(25))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="cuda_mem_diag.json")
    ap.add_argument("--seq-len", type=int, default=32768)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29534")
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    out = dict(device=torch.cuda.get_device_name() if cuda else "cpu", attention=[], steps=[])
    for name, (hq, hkv, d) in SHAPES.items():
        for cudnn in ((True, False) if cuda else (True,)):
            try:
                out["attention"].append(dict(model=name, **attention_peak(args.seq_len, hq, hkv, d, device, cudnn)))
            except Exception as exc:  # noqa: BLE001
                out["attention"].append(dict(model=name, cudnn=cudnn, error=f"{type(exc).__name__}: {exc}"[:300]))
            print(json.dumps(out["attention"][-1]), flush=True)
    if cuda:
        base = TrainConfig(model="small-l3", seq_len=args.seq_len, batch=1, steps=10, lr=1e-4, warmup=0,
                           dtype="bfloat16", checkpointing="remat", mlp_chunk=4096, loss_chunk=1024)
        for cfg in (base, base.with_overrides(checkpointing="none", mlp_chunk=0, loss_chunk=0)):
            try:
                out["steps"].append(step_peak_blocks(cfg))
            except Exception as exc:  # noqa: BLE001
                out["steps"].append(dict(error=f"{type(exc).__name__}: {exc}"[:300]))
            print(json.dumps(out["steps"][-1], default=str)[:3000], flush=True)
    dist.destroy_process_group()
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    main()

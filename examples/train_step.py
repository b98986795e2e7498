"""One attention training step over a sequence sharded across every rank of a torchrun job.

    # one machine, 2 CPU processes (gloo):
    torchrun --nproc-per-node 2 examples/train_step.py
    # 2 machines x 8 GPUs (NCCL), run on each machine:
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        examples/train_step.py --seq-len 131072 --dtype bfloat16

Each rank builds its shard of q/k/v ([batch, seq/P, heads, head_dim]), runs ``burst_attn_func``
forward and backward, then checks a random sample of query rows (output and dq) against a
float64 recomputation over all keys, and rank 0 prints the largest error. Every rank draws the
full-sequence inputs from one seed so the check needs no extra communication; a real model would
produce only its shard (from its own tokens, with RoPE at ``sequence_positions``).
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

import burstattn
from burstattn.testing.oracle import exact_rows


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=8192, help="global sequence length")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--layout", default="zigzag", choices=("contiguous", "zigzag", "striped"))
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--check-rows", type=int, default=64, help="sampled query rows checked in float64")
    return p.parse_args()


def main() -> None:
    args = parse()
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if use_cuda else "gloo")  # env:// from torchrun
    rank, world = dist.get_rank(), dist.get_world_size()
    if not use_cuda:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    dtype = getattr(torch, args.dtype)
    n_kv = args.kv_heads or args.heads

    # the same full-sequence tensors on every rank (one seed); each keeps its own shard
    gen = torch.Generator().manual_seed(0)
    shape = (1, args.seq_len)
    q_full = torch.randn(*shape, args.heads, args.head_dim, generator=gen).to(dtype)
    k_full = torch.randn(*shape, n_kv, args.head_dim, generator=gen).to(dtype)
    v_full = torch.randn(*shape, n_kv, args.head_dim, generator=gen).to(dtype)
    rows = torch.randperm(args.seq_len, generator=gen)[:args.check_rows].sort().values  # global positions
    q, k, v = (burstattn.shard_sequence(x, layout=args.layout).to(device).requires_grad_()
               for x in (q_full, k_full, v_full))                          # [1, seq/P, heads, head_dim]
    positions = burstattn.sequence_positions(args.seq_len, layout=args.layout)  # global position of each local row

    t0 = time.perf_counter()
    out = burstattn.burst_attn_func(q, k, v, causal=args.causal, layout=args.layout)
    held = torch.isin(positions, rows)                                     # sampled rows this rank holds
    loss = out[:, held.to(device)].float().sum()                           # gradient only through them
    loss.backward()
    if use_cuda:
        torch.cuda.synchronize()
    step_s = time.perf_counter() - t0

    # float64 check of the sampled rows this rank holds: output and dq
    q_rows = q_full[:, positions[held]].double().requires_grad_()
    ref, _ = exact_rows(q_rows, k_full.double(), v_full.double(), positions[held], causal=args.causal)
    ref.sum().backward()
    err = torch.zeros(2, dtype=torch.float64)
    if held.any():
        err[0] = (out.detach()[:, held.to(device)].double().cpu() - ref.detach()).abs().max()
        err[1] = (q.grad[:, held.to(device)].double().cpu() - q_rows.grad).abs().max()
    err = err.to(device)
    dist.all_reduce(err, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"world {world} on {device.type}, seq {args.seq_len} ({args.seq_len // world} per rank), "
              f"{args.dtype}, causal={args.causal}, layout={args.layout}: fwd+bwd {step_s:.3f} s; "
              f"max abs error on {rows.numel()} sampled rows: out {err[0].item():.2e}, dq {err[1].item():.2e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

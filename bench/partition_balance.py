"""``burstattn bench partition``: :func:`burstattn.mask_partition` against the best of zigzag, striped
and contiguous, per mask, in real processes.

Masks (causal, N = ``seq_len``): sliding windows of N/8 and N/32 keys; long-tailed packed documents
(lognormal lengths, median N/64, sigma 1.5, at most N/2, from a fixed seed); a local-plus-global
block-sparse ``mask_mod`` (blocks of N/32 see themselves, every query sees the first N/32 keys).

Per mask and layout:

* ``work``: max / mean of each rank's weighted tile work under the plan actually run (every pair op's
  area times its class's cost, :class:`burstattn.masks.partition_solver.TileCosts`);
* ``bytes``: what the sparse plan sends in a forward + backward, summed over ranks, by its own formula
  (:func:`burstattn.masks.mask_bytes`);
* ``cpu``: each rank's CPU seconds of its own thread (``time.thread_time``) per forward + backward of
  :func:`burstattn.burst_attn_func`, median over ``steps`` (after one warm-up), the slowest rank's
  reported. Arms alternate inside every step, so load drifts hit them alike. A cluster waits for its
  slowest rank, and here the ranks share cores, so wall clock cannot show the imbalance.
"""
from __future__ import annotations

import argparse
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Optional

import torch

LAYOUTS = ("contiguous", "zigzag", "striped", "mask_partition")
MASKS = ("window_n8", "window_n32", "documents", "local_global")


@dataclass(frozen=True)
class PartitionBenchConfig:
    """One run: ``world_size`` ranks, ``seq_len`` tokens, ``heads`` x ``head_dim`` (float32)."""

    seq_len: int = 32768
    world_size: int = 4
    steps: int = 3
    heads: int = 2
    head_dim: int = 32
    block_size: int = 256
    backend: str = "cpu_flash"
    docs: Optional[str] = None


def long_tailed(seq_len: int, seed: int = 0) -> list[int]:
    """``cu_seqlens`` of lognormal document lengths (median N/64, sigma 1.5, 16..N/2), packed to N."""
    gen = torch.Generator().manual_seed(seed)
    cu, median = [0], seq_len / 64
    while cu[-1] < seq_len:
        length = float(torch.exp(torch.randn((), generator=gen, dtype=torch.float64) * 1.5) * median)
        cu.append(min(cu[-1] + int(min(max(length, 16), seq_len // 2)), seq_len))
    return cu


class LocalGlobal:
    """Local blocks of ``span`` tokens plus the first ``span`` keys (picklable, compares by span)."""

    def __init__(self, span: int) -> None:
        self.span = span

    def __call__(self, q, k):
        return (q // self.span == k // self.span) | (k < self.span)


def build_mask(name: str, seq_len: int, block_size: int):
    """The named mask at ``seq_len`` (an :class:`burstattn.AttnMask`)."""
    from burstattn.masks import AttnMask

    kw = {"window_n8": dict(window=(seq_len // 8, 0)), "window_n32": dict(window=(seq_len // 32, 0)),
          "documents": dict(cu_seqlens=long_tailed(seq_len)),
          "local_global": dict(mask_mod=LocalGlobal(seq_len // 32))}[name]
    return AttnMask(block_size=block_size, **kw)


def layout_of(name: str, mask, seq_len: int, world: int):
    if name != "mask_partition":
        return name
    from burstattn.masks.partition_solver import mask_partition

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the figure below reports the balance either way
        return mask_partition(mask, seq_len, world, causal=True)


def plan_figures(mask, layout, cfg: PartitionBenchConfig) -> dict:
    """Weighted work balance and fwd+bwd bytes (all ranks) of the sparse plan (pure)."""
    from burstattn.masks import choose_mask_backward, mask_bytes, mask_plan
    from burstattn.layouts.partition import balance
    from burstattn.masks.partition_solver import TileCosts

    n, p = cfg.seq_len, cfg.world_size
    w = TileCosts().table()
    kinds = {"full": 1, "partial": 2, "causal": 3, "strict": 4}
    shape = dict(batch=1, local_seq=n // p, q_heads=cfg.heads, kv_heads=cfg.heads, head_dim=cfg.head_dim,
                 dtype=torch.float32)
    backward = choose_mask_backward(**shape)
    work, sent = [], 0
    for r in range(p):
        plan = mask_plan(mask, True, n, p, layout, r)
        work.append(sum(float(w[kinds[op.mask.value]]) * (op.q_stop - op.q_start) * (op.k_stop - op.k_start)
                        for row in plan.row for op in row))
        nbytes = mask_bytes(plan, backward=backward, **shape)
        sent += nbytes["forward"] + nbytes["backward"]
    return dict(work=balance(work), max_work=max(work), bytes=sent)


def rank_times(rank: int, world: int, cfg: PartitionBenchConfig, masks: tuple) -> dict:
    """Per (mask, layout): this rank's thread CPU seconds of every fwd+bwd step (first is warm-up)."""
    import burstattn

    n = cfg.seq_len
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(1, n, cfg.heads, cfg.head_dim, generator=gen) for _ in range(4)]
    arms = []
    for name in masks:
        mask = build_mask(name, n, cfg.block_size)
        for lay in LAYOUTS:
            layout = layout_of(lay, mask, n, world)
            pos = burstattn.sequence_positions(n, layout=layout) if isinstance(layout, str) \
                else layout.positions_of(rank)
            arms.append(((name, lay), mask, layout, [x.index_select(1, pos) for x in full]))
    out = {key: [] for key, *_ in arms}
    for _ in range(cfg.steps + 1):
        for key, mask, layout, (q, k, v, g) in arms:
            q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
            t = time.thread_time()
            burstattn.burst_attn_func(q, k, v, causal=True, mask=mask, layout=layout,
                                      backend=cfg.backend).backward(g)
            out[key].append(time.thread_time() - t)
    return out


def run(cfg: PartitionBenchConfig, masks: tuple = MASKS) -> list[dict]:
    """Every (mask, layout) row: work balance, bytes, the slowest rank's median CPU seconds."""
    from burstattn.testing.launch import LocalPool

    pool = LocalPool(cfg.world_size, backend="gloo", threads_per_rank=1, timeout_s=3600.0, pg_timeout_s=600.0)
    try:
        per_rank = pool.run(rank_times, cfg, masks)
    finally:
        pool.close()
    rows = []
    for name in masks:
        mask = build_mask(name, cfg.seq_len, cfg.block_size)
        for lay in LAYOUTS:
            layout = layout_of(lay, mask, cfg.seq_len, cfg.world_size)
            cpu = [statistics.median(r[(name, lay)][1:]) for r in per_rank]
            rows.append(dict(mask=name, layout=lay if isinstance(layout, str) else layout.name,
                             **plan_figures(mask, layout, cfg), slowest_cpu_s=max(cpu),
                             mean_cpu_s=sum(cpu) / len(cpu)))
    return rows


def markdown(rows: list[dict], cfg: PartitionBenchConfig) -> str:
    head = (f"World {cfg.world_size}, N = {cfg.seq_len}, {cfg.heads} heads x {cfg.head_dim}, float32, "
            f"`{cfg.backend}`, tiles of {cfg.block_size}, causal; CPU s = median over {cfg.steps} steps "
            f"of fwd+bwd, each rank's own thread (`time.thread_time`).\n\n"
            "| mask | layout | max/mean work | max work (M entries x cost) | fwd+bwd bytes (all ranks) "
            "| slowest rank CPU s | mean rank CPU s |\n|---|---|---:|---:|---:|---:|---:|\n")
    body = "".join(f"| {r['mask']} | {r['layout']} | {r['work']:.3f} | {r['max_work'] / 1e6:.1f} | {r['bytes'] / 2**20:.1f} MiB | "
                   f"{r['slowest_cpu_s']:.3f} | {r['mean_cpu_s']:.3f} |\n" for r in rows)
    return head + body


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``burstattn bench partition``."""
    d = PartitionBenchConfig()
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--world-size", type=int, default=d.world_size)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--masks", nargs="+", choices=MASKS, default=list(MASKS))
    p.add_argument("--docs", default=None, metavar="FILE", help="also append the table to FILE")


def run_cli(ns: argparse.Namespace) -> int:
    cfg = PartitionBenchConfig(seq_len=ns.seq_len, world_size=ns.world_size, steps=ns.steps, docs=ns.docs)
    if cfg.seq_len % (cfg.world_size * cfg.block_size):
        raise ValueError(f"--seq-len {cfg.seq_len} must be a multiple of world size x {cfg.block_size}")
    text = markdown(run(cfg, tuple(ns.masks)), cfg)
    print(text)
    if cfg.docs:
        with open(cfg.docs, "a") as f:
            f.write("\n" + text)
    return 0

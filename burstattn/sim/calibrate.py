"""``burstattn sim calibrate``: this machine as a cluster spec (kernel rates, memory bandwidth, and
the gloo group's point-to-point bandwidth and latency between two local processes).

The spec file holds ``"hw"`` (a :class:`~.hardware.ClusterHW`: ``--cluster FILE`` of ``burstattn sim``
and ``plan``) and ``"cluster"`` (links as ``BANDWIDTH[,LATENCY]``: ``--cluster-spec FILE`` of ``burstattn
cluster up``, or ``bench --cluster FILE``). Rates are per rank at ``threads`` threads; timing runs
should hold ``flock /tmp/burstattn-bench.lock``. Every figure is the fastest of its repeats, since other
processes on the machine can only slow a measurement down.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .hardware import ClusterHW


def _rate(fn, flops: float, seconds: float) -> float:
    fn()
    times, start = [], time.perf_counter()
    while time.perf_counter() - start < seconds or len(times) < 3:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return flops / min(times)  # the fastest repeat: work of other processes only ever slows one down


def forward_rate(seconds: float = 1.0, seq: int = 1024, heads: int = 8, head_dim: int = 64) -> float:
    """The one kernel FLOP/s calibration: the auto-selected local kernel's attention forward on one block of
    ``seq x seq`` (float32, ``heads`` heads; FLOPs ``4 * seq^2 * d * heads``), the fastest repeat."""
    from ..kernels import get_kernel, resolve_backend

    q, k, v = (torch.randn(1, heads, seq, head_dim) for _ in range(3))
    kernel = get_kernel(resolve_backend("auto", q.device, q.dtype))
    return _rate(lambda: kernel.forward(q, k, v, head_dim ** -0.5, False), 4 * seq * seq * head_dim * heads, seconds)


def kernel_rates(seq: int = 1024, heads: int = 8, head_dim: int = 64, seconds: float = 1.0,
                 plain: bool = True) -> dict:
    """Attention forward / backward FLOP/s of the auto-selected local kernel (float32, one block of
    ``seq x seq``, forward FLOPs ``4 * seq^2 * d * heads``: :func:`forward_rate`; backward 2.5x), its
    causal-block efficiency, the matmul rate, the memory bandwidth (a copy) and the score entries/s of
    attention from plain matmuls with materialised scores (:func:`plain_rates`)."""
    from ..kernels import get_kernel, resolve_backend

    q, k, v = (torch.randn(1, heads, seq, head_dim) for _ in range(3))
    kernel = get_kernel(resolve_backend("auto", q.device, q.dtype))
    flops = 4 * seq * seq * head_dim * heads
    scale = head_dim ** -0.5
    fwd = forward_rate(seconds, seq, heads, head_dim)
    # the causal (diagonal) block against a full one of the same size, at 2048 (the kernel skips more
    # of a larger causal block, so a small one would understate it)
    q2, k2, v2 = (torch.randn(1, heads, 2 * seq, head_dim) for _ in range(3))
    causal = _rate(lambda: kernel.forward(q2, k2, v2, scale, True), 2 * flops, seconds) / _rate(
        lambda: kernel.forward(q2, k2, v2, scale, False), 4 * flops, seconds) * fwd
    out, lse = kernel.forward(q, k, v, scale, False)
    dout = torch.randn_like(q)
    bwd = _rate(lambda: kernel.backward(dout, q, k, v, out.to(q.dtype), lse, scale, False), 2.5 * flops, seconds)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    mm = _rate(lambda: a @ b, 2 * 1024 ** 3, seconds)
    x = torch.empty(32 * 2**20 // 4)
    y = torch.empty_like(x)
    bw = _rate(lambda: y.copy_(x), 2 * x.numel() * 4, seconds)
    rates = {"attn_fwd": fwd, "attn_bwd": bwd, "causal_eff": min(1.0, causal / fwd), "matmul": mm, "mem_bw": bw,
             "backend": kernel.name}
    if not plain:
        return rates
    # RSA keeps n x N scores far larger than any cache: time it on a 2048 x 4096 block (256 MiB of scores)
    qq, kk, vv = torch.randn(1, heads, 2048, head_dim), torch.randn(1, heads, 4096, head_dim), torch.randn(
        1, heads, 4096, head_dim)
    pf, pb = plain_rates(qq, kk, vv, torch.randn_like(qq), seconds)
    return {**rates, "plain_fwd": pf, "plain_bwd": pb}


def plain_rates(q, k, v, dout, seconds: float) -> tuple[float, float]:
    """Score entries/s of Ring Self-Attention's block work (:mod:`burstattn.strategies.rsa`): forward
    ``S = q k^T * scale``, an in-place softmax, ``S @ v``; backward ``dS = P * (dO v^T - D)``,
    ``dq += dS k``, ``dk = dS^T q``, ``dv = P^T dO`` (fresh score tensors every call, as there)."""
    scale = q.shape[-1] ** -0.5
    entries = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2]
    delta = (dout * q).sum(-1, keepdim=True)

    def fwd():
        s = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
        torch.softmax(s, dim=-1, out=s)
        return torch.matmul(s, v)

    def bwd():
        p = torch.softmax(torch.matmul(q, k.transpose(-1, -2)).mul_(scale), dim=-1)
        ds = p * (torch.matmul(dout, v.transpose(-1, -2)) - delta)
        return torch.matmul(ds, k), torch.matmul(ds.transpose(-1, -2), q), torch.matmul(p.transpose(-1, -2), dout)

    f = _rate(fwd, entries, seconds)
    b_with_fwd_scores = _rate(bwd, entries, seconds)
    return f, 1 / max(1 / b_with_fwd_scores - 0.5 / f, 1e-30)  # the backward reads stored P: drop its rebuild


def _worker(rank: int, world: int, port: int, seconds: float, rounds: int, repeats: int, queue) -> None:
    """One rank: the kernel rates while every rank computes (``rounds``, best of each), then the
    point-to-point ping-pong between ranks 0 and 1 while the others wait. Rank 0 reports each stage
    (``("progress", text)``) and the result (``("done", (rates, link))``) on ``queue``."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    say = (lambda text: queue.put(("progress", text))) if rank == 0 else (lambda text: None)
    best: dict = {}
    for i in range(rounds):
        dist.barrier()
        say(f"kernel rates, round {i + 1}/{rounds} ({world} ranks computing at once)")
        for key, value in kernel_rates(seconds=seconds).items():
            best[key] = value if isinstance(value, str) else max(value, best.get(key, 0.0))
    res = {}
    for nbytes in (4096, 16 * 2**20):
        say(f"gloo point-to-point, {nbytes // 1024:,} KiB x {repeats} round trips")
        buf = torch.empty(nbytes // 4)
        times = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            elif rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            times.append((time.perf_counter() - t0) / 2)
        res[nbytes] = min(times)  # the fastest repeat: other processes only ever slow one down
    gathered = [None] * world
    dist.all_gather_object(gathered, best)
    if rank == 0:
        lat = res[4096]
        rates = {k: (v if isinstance(v, str) else min(g[k] for g in gathered)) for k, v in best.items()}
        queue.put(("done", (rates, {"latency_s": lat, "bandwidth": 16 * 2**20 / max(res[16 * 2**20] - lat, 1e-9)})))
    dist.destroy_process_group()


def measure(ranks: int = 2, seconds: float = 1.0, rounds: int = 3, repeats: int = 15,
            progress: Optional[Callable[[str], None]] = None) -> tuple[dict, dict]:
    """``(rates, link)`` from ``ranks`` spawned processes of one thread each computing at once
    (the slowest rank's best rates: a rank's rate when its neighbours compute too, as in a run),
    and the gloo one-way link between two of them: latency (4 KiB ping-pong), bandwidth (16 MiB:
    ``bytes / (time - latency)``). ``progress(text)`` is called at each stage (the whole takes about
    ``rounds * 10 * seconds`` seconds of kernel timing, plus starting the processes).

    Raises:
        RuntimeError: a rank died or nothing came back within 600 s per stage.
    """
    import queue as queue_mod
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, ranks, port, seconds, rounds, repeats, queue)) for r in range(ranks)]
    for p in procs:
        p.start()
    try:
        while True:
            try:
                kind, value = queue.get(timeout=600)
            except queue_mod.Empty:
                raise RuntimeError("sim calibrate: no progress from the measuring processes in 600 s") from None
            if kind == "done":
                if progress is not None:
                    progress("blockwise chunk cost (one process, tiny model, whole vs 16-token chunks)")
                from .chunk_cost import measure_chunk_cost

                value[0]["chunk_overhead_s"] = measure_chunk_cost(repeats=max(3, rounds))["chunk_overhead_s"]
                return value
            if progress is not None:
                progress(value)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()


@dataclass(frozen=True)
class Calibration:
    hw: ClusterHW
    rates: dict
    link: dict


def calibrate(seconds: float = 1.0, ranks: int = 2, rounds: int = 3,
              progress: Optional[Callable[[str], None]] = None) -> Calibration:
    """Measure this machine (one thread per rank, ``ranks`` ranks per 'node') as a :class:`ClusterHW`:
    ``peak_flops`` is the measured matmul rate (efficiency 1), the attention efficiencies are the
    kernel's rates over it, both link levels are the measured gloo point-to-point link.
    ``progress(text)``: called at each stage (:func:`measure`)."""
    rates, link = measure(ranks, seconds, rounds, progress=progress)
    peak = rates["matmul"]
    hw = ClusterHW(
        "calibrated", ranks, peak, 1.0, rates["attn_fwd"] / peak, rates["attn_bwd"] / peak, rates["causal_eff"],
        rates["mem_bw"], float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / ranks,
        intra_bw=link["bandwidth"], intra_lat=link["latency_s"], inter_bw=link["bandwidth"],
        inter_lat=link["latency_s"], kernel_overhead_s=20e-6, plain_attn_rates=(rates["plain_fwd"], rates["plain_bwd"]),
        host_is_device=True, chunk_overhead_s=rates.get("chunk_overhead_s"),
        sources={"all": f"measured by `burstattn sim calibrate` on this machine ({os.cpu_count()} cores, {ranks} "
                        f"ranks of 1 thread computing at once, kernel {rates['backend']}, gloo point-to-point)"})
    return Calibration(hw, rates, link)


def cluster_section(cal: Calibration, nodes: int = 1, ranks_per_node: int = 2) -> dict:
    """The ``"cluster"`` object for ``burstattn cluster up --cluster-spec``: both levels the
    measured link (bandwidth in bytes/s written as MB, latency in ms)."""
    link = f"{cal.link['bandwidth'] / 1e6:.6g}mb,{cal.link['latency_s'] * 1e3:.4g}ms"
    return {"name": "calibrated", "nodes": nodes, "ranks_per_node": ranks_per_node, "inter": link, "intra": link,
            "local_flops": cal.rates["attn_fwd"]}

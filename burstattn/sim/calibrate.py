"""``burstattn sim calibrate``: this machine as a cluster spec (kernel rates, memory bandwidth, and
the gloo group's point-to-point bandwidth and latency between two local processes).

The spec file holds ``"hw"`` (a :class:`~.hardware.ClusterHW`: ``--cluster FILE`` of ``burstattn sim``
and ``plan``) and ``"cluster"`` (links as ``BANDWIDTH[,LATENCY]``: ``--cluster-spec FILE`` of ``burstattn
cluster up``, or ``bench --cluster FILE``). Rates are per rank at ``threads`` threads; timing runs
should hold ``flock /tmp/burstattn-bench.lock``.
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass

import torch

from .hardware import ClusterHW


def _rate(fn, flops: float, seconds: float) -> float:
    fn()
    times, start = [], time.perf_counter()
    while time.perf_counter() - start < seconds or len(times) < 3:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return flops / statistics.median(times)


def kernel_rates(seq: int = 2048, heads: int = 8, head_dim: int = 64, seconds: float = 1.0) -> dict:
    """Attention forward / backward FLOP/s of the auto-selected local kernel (float32, one block of
    ``seq x seq``, forward FLOPs ``4 * seq^2 * d * heads``, backward 2.5x), its causal-block
    efficiency, the matmul rate and the memory bandwidth (a copy)."""
    from ..kernels import get_kernel, resolve_backend

    q, k, v = (torch.randn(1, heads, seq, head_dim) for _ in range(3))
    kernel = get_kernel(resolve_backend("auto", q.device, q.dtype))
    flops = 4 * seq * seq * head_dim * heads
    scale = head_dim ** -0.5
    fwd = _rate(lambda: kernel.forward(q, k, v, scale, False), flops, seconds)
    causal = _rate(lambda: kernel.forward(q, k, v, scale, True), flops / 2, seconds)
    out, lse = kernel.forward(q, k, v, scale, False)
    dout = torch.randn_like(q)
    bwd = _rate(lambda: kernel.backward(dout, q, k, v, out.to(q.dtype), lse, scale, False), 2.5 * flops, seconds)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    mm = _rate(lambda: a @ b, 2 * 1024 ** 3, seconds)
    x = torch.empty(32 * 2**20 // 4)
    y = torch.empty_like(x)
    bw = _rate(lambda: y.copy_(x), 2 * x.numel() * 4, seconds)
    return {"attn_fwd": fwd, "attn_bwd": bwd, "causal_eff": min(1.0, causal / fwd), "matmul": mm, "mem_bw": bw,
            "backend": kernel.name}


def _p2p_worker(rank: int, port: int, sizes: list, repeats: int, queue) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    res = {}
    for nbytes in sizes:
        buf = torch.empty(nbytes // 4)
        times = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            times.append((time.perf_counter() - t0) / 2)
        res[nbytes] = statistics.median(times)
    if rank == 0:
        queue.put(res)
    dist.destroy_process_group()


def p2p_link(repeats: int = 9) -> dict:
    """One-way gloo point-to-point between two local processes: latency (4 KiB ping-pong) and
    bandwidth (16 MiB: ``bytes / (time - latency)``)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    small, large = 4096, 16 * 2**20
    procs = [ctx.Process(target=_p2p_worker, args=(r, port, [small, large], repeats, queue)) for r in range(2)]
    for p in procs:
        p.start()
    res = queue.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
    lat = res[small]
    return {"latency_s": lat, "bandwidth": large / max(res[large] - lat, 1e-9)}


@dataclass(frozen=True)
class Calibration:
    hw: ClusterHW
    rates: dict
    link: dict


def calibrate(seconds: float = 1.0, ranks: int = 2) -> Calibration:
    """Measure this machine (one thread per rank, ``ranks`` ranks per 'node') as a :class:`ClusterHW`:
    ``peak_flops`` is the measured matmul rate (efficiency 1), the attention efficiencies are the
    kernel's rates over it, both link levels are the measured gloo point-to-point link."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rates = kernel_rates(seconds=seconds)
    finally:
        torch.set_num_threads(old)
    link = p2p_link()
    peak = rates["matmul"]
    hw = ClusterHW(
        "calibrated", ranks, peak, 1.0, rates["attn_fwd"] / peak, rates["attn_bwd"] / peak, rates["causal_eff"],
        rates["mem_bw"], float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / ranks,
        intra_bw=link["bandwidth"], intra_lat=link["latency_s"], inter_bw=link["bandwidth"],
        inter_lat=link["latency_s"], intra_shared=False, inter_shared=False, kernel_overhead_s=20e-6,
        sources={"all": f"measured by `burstattn sim calibrate` on this machine ({os.cpu_count()} cores, "
                        f"1 thread per rank, kernel {rates['backend']}, gloo point-to-point)"})
    return Calibration(hw, rates, link)


def cluster_section(cal: Calibration, nodes: int = 1, ranks_per_node: int = 2) -> dict:
    """The ``"cluster"`` object for ``burstattn cluster up --cluster-spec``: both levels the
    measured link (bandwidth in bytes/s written as MB, latency in ms)."""
    link = f"{cal.link['bandwidth'] / 1e6:.6g}mb,{cal.link['latency_s'] * 1e3:.4g}ms"
    return {"name": "calibrated", "nodes": nodes, "ranks_per_node": ranks_per_node, "inter": link, "intra": link,
            "local_flops": cal.rates["attn_fwd"]}

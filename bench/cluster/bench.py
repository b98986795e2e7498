"""``burstattn bench --cluster PRESET|SPEC``: the strategies grid on an emulated cluster.

The parent (root namespace) brings the cluster up, starts one ``torchrun`` agent per node
(:mod:`.launch`) running ``python -m bench.cluster.worker grid``, collects every rank's JSON and
tears the cluster down. It does this twice: on the shaped cluster and on the same topology with
unshaped links (the compute-bound baseline). Each rank runs the grid's own point function
(:func:`bench.grid.grid_point`: correctness against float64 first, then bytes, then
interleaved timed forward and forward + backward calls), plus one traced forward + backward that
yields the time spent waiting for transfers (``wait`` events of the ring loops) and the node's
interface counters around it (bytes over the inter-node link, ``btnet0``, and the intra-node one,
``lo``).

Exposed communication is reported two ways: ``shaped - unshaped`` median time (every strategy: what
the slow links cost), and the traced waits (strategies built on the ring loops).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Optional

from bench.cluster.spec import ClusterSpec, Link

STRATEGIES = ("burst", "burst-double", "ring", "rsa", "ulysses", "allgather", "usp")


def task_grid(cfg: dict) -> dict:
    """Rank side: every strategy point of ``cfg`` (:func:`bench.grid.grid_point`) plus
    the traced waits and interface counters of one forward + backward."""
    import torch
    import torch.distributed as dist

    from bench.grid import GridPoint, contender, grid_point
    from burstattn.comm.trace import trace_steps
    from bench.cluster.netns import iface_tx

    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for name in cfg["strategies"]:
        p = GridPoint(name, cfg["seq_len"], cfg["causal"], "float32", cfg["heads"], cfg["kv_heads"], cfg["head_dim"],
                      1, cfg["repeats"], 0, cfg["check_seq_len"], cfg["ranks_per_node"])
        rec = grid_point(rank, world, p, None)
        if "measured" in rec:
            c = contender(p, world)
            n = p.seq_len // world
            gen = torch.Generator().manual_seed(rank)
            q, k, v = (torch.randn(1, n, h, p.head_dim, generator=gen).requires_grad_()
                       for h in (p.heads, p.kv_heads, p.kv_heads))
            dist.barrier()
            before, t0 = iface_tx(), time.perf_counter()
            with trace_steps() as tr:
                c.fn(q, k, v).sum().backward()
            dist.barrier()
            rec["traced_s"] = time.perf_counter() - t0
            after = iface_tx()
            rec["iface"] = {kind: after[kind] - before[kind] for kind in after}
            rec["wait_s"] = sum(e["t1_ns"] - e["t0_ns"] for e in tr.events if e["name"] == "wait") / 1e9
            rec["compute_s"] = sum(e["t1_ns"] - e["t0_ns"] for e in tr.events if e["name"] == "compute") / 1e9
        out.append(rec)
    return {"points": out}


def _combine(cfg: dict, ranks: list[dict], spec: ClusterSpec) -> list[dict]:
    from bench.grid import GridPoint, combine

    records = []
    for i, name in enumerate(cfg["strategies"]):
        p = GridPoint(name, cfg["seq_len"], cfg["causal"], "float32", cfg["heads"], cfg["kv_heads"], cfg["head_dim"],
                      1, cfg["repeats"], 0, cfg["check_seq_len"], cfg["ranks_per_node"])
        per_rank = [r["points"][i] for r in ranks]
        rec = combine(p, len(ranks), per_rank)
        if "iface" in per_rank[0]:
            r_per_node = spec.ranks_per_node
            firsts = [per_rank[node * r_per_node] for node in range(spec.nodes)]  # one reading per node
            rec["iface_per_rank"] = {kind: max(f["iface"][kind] for f in firsts) / r_per_node
                                     for kind in ("inter", "intra")}
            rec["wait_s"] = max(r["wait_s"] for r in per_rank)
            rec["traced_s"] = max(r["traced_s"] for r in per_rank)
        records.append(rec)
    return records


def run_on_cluster(spec: ClusterSpec, cfg: dict, timeout_s: float = 3600) -> tuple[list[dict], ClusterSpec]:
    """Bring ``spec`` up, run the grid worker on it, tear it down; the combined records and the spec
    actually applied (latencies dropped where the kernel has no netem)."""
    from bench.cluster.launch import run_worker_task

    cfg = dict(cfg, ranks_per_node=spec.ranks_per_node)
    ranks, applied = run_worker_task(spec, "grid", cfg, timeout_s)
    return _combine(cfg, ranks, applied), applied


def run_cluster_bench(cluster: str, *, nodes: int = 2, ranks_per_node: int = 2, seq_len: int = 8192,
                      causal: bool = False, strategies=STRATEGIES, repeats: int = 3, heads: int = 8,
                      kv_heads: int = 8, head_dim: int = 64, check_seq_len: int = 512,
                      out: str = "bench-out", docs: Optional[str] = None, console=None) -> dict:
    """Calibrate, resolve ``cluster`` (preset or spec), run shaped and unshaped, write JSON/Markdown."""
    from bench.cluster.spec import rank_flops, resolve

    say = console.print if console is not None else print
    world = nodes * ranks_per_node
    cores = os.cpu_count() or 1
    local = rank_flops(world)  # ranks share the cores: each computes this fast
    per_core = local / min(1.0, cores / world)
    spec = resolve(cluster, nodes, ranks_per_node, local_flops=local)
    say(f"bench --cluster: kernel {per_core / 1e9:.1f} GFLOP/s per core, {local / 1e9:.1f} per rank "
        f"({world} ranks on {cores} cores); {spec.describe()}")
    cfg = dict(strategies=list(strategies), seq_len=seq_len, causal=causal, heads=heads, kv_heads=kv_heads,
               head_dim=head_dim, repeats=repeats, check_seq_len=check_seq_len, pg_timeout_s=600, threads=1)
    t0 = time.perf_counter()
    shaped, applied = run_on_cluster(spec, cfg)
    base, _ = run_on_cluster(replace(spec, inter=Link(None), intra=Link(None), name="unshaped"), cfg)
    result = dict(spec=asdict(applied), requested=asdict(spec), local_flops=local, per_core_flops=per_core,
                  config=cfg, shaped=shaped, unshaped=base, wall_s=time.perf_counter() - t0,
                  date=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    Path(out).mkdir(parents=True, exist_ok=True)
    stem = f"cluster-{spec.name}-{'causal' if causal else 'full'}-{seq_len}"
    (Path(out) / f"{stem}.json").write_text(json.dumps(result, indent=1, default=str))
    from bench.cluster.report import cluster_markdown
    md = cluster_markdown(result)
    (Path(out) / f"{stem}.md").write_text(md)
    say(md)
    if docs:
        from bench.cluster.report import append_section
        append_section(docs, result, md)
    return result

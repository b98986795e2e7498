"""``burstattn bench infer --cluster PRESET``: first-token latency per strategy on an emulated cluster.

Like :mod:`.bench`: the parent brings the cluster up, runs ``python -m bench.cluster.worker
infer`` under one ``torchrun`` agent per node, collects every rank's JSON and tears the cluster
down. Each rank runs the sharded prefill (:func:`burstattn.infer.steps.prefill`) of the preset
model for every strategy and prompt length: one warm-up, then ``repeats`` timed calls from a
barrier, one strategy after another, plus the bytes it sent; then (with ``crossover_new``) the
pass-KV / pass-Q continuation suite of :mod:`bench.infer`.
"""
from __future__ import annotations

import time


def task_infer(cfg: dict) -> dict:
    """Rank side: ``{"rows": [{strategy, prompt_len, samples, median_s, sent_bytes}, ...]}``."""
    import torch.distributed as dist

    from bench.infer import InferBenchConfig, crossover_rank, prefill_rank

    bench = InferBenchConfig(model=cfg["model"], prompt_lens=tuple(cfg["prompt_lens"]), repeats=cfg["repeats"],
                             seed=cfg.get("seed", 0), crossover_cache=cfg["crossover_cache"],
                             crossover_new=tuple(cfg["crossover_new"]))
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = prefill_rank(rank, world, bench, tuple(cfg["strategies"]))
    return {"rows": rows, "crossover": crossover_rank(rank, world, bench) if bench.crossover_new else []}


def run_infer_cluster(cluster: str, *, nodes: int = 2, ranks_per_node: int = 1, model: str = "small",
                      strategies=("burst", "ulysses", "tp", "allgather", "rsa"), prompt_lens=(2048, 4096, 8192),
                      repeats: int = 3, crossover_cache: int = 2048, crossover_new=(), timeout_s: float = 7200.0,
                      say=print) -> dict:
    """Calibrate, bring ``cluster`` (a preset or spec) up, run :func:`task_infer`, tear it down.
    Returns ``{"spec", "rows", "crossover" (max over ranks), "wall_s", ...}``."""
    from dataclasses import asdict

    from bench.cluster.launch import run_worker_task
    from bench.cluster.spec import rank_flops, resolve

    world = nodes * ranks_per_node
    local = rank_flops(world)
    spec = resolve(cluster, nodes, ranks_per_node, local_flops=local)
    say(f"bench infer --cluster: {spec.describe()}")
    cfg = dict(model=model, strategies=list(strategies), prompt_lens=list(prompt_lens), repeats=repeats,
               crossover_cache=crossover_cache, crossover_new=list(crossover_new), pg_timeout_s=1800, threads=1)
    t0 = time.perf_counter()
    ranks, applied = run_worker_task(spec, "infer", cfg, timeout_s)
    rows = []
    for per_rank in zip(*(r["rows"] for r in ranks)):
        row = dict(per_rank[0])
        row["median_s"] = max(x["median_s"] for x in per_rank)
        row["sent_bytes"] = max(x["sent_bytes"] for x in per_rank)
        rows.append(row)
    crossover = [dict(r, median_s={k: max(x["median_s"][k] for x in per) for k in ("kv", "q")})
                 for r, per in zip(ranks[0]["crossover"], zip(*(r["crossover"] for r in ranks)))]
    return dict(spec=asdict(applied), requested=asdict(spec), local_flops=local, rows=rows, crossover=crossover,
                wall_s=time.perf_counter() - t0, date=time.strftime("%Y-%m-%dT%H:%M:%S%z"))

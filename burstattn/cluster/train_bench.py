"""``burstattn bench train --cluster PRESET``: training steps per strategy on an emulated cluster.

Like :mod:`.infer_bench`: the parent calibrates this machine, brings the cluster up (``nodes`` x
``ranks_per_node`` ranks, links scaled to the preset's compute-to-link ratio), runs ``python -m
burstattn.cluster.worker train`` under one multi-node ``torchrun`` agent per node, collects every
rank's records and tears the cluster down. Each rank runs :func:`burstattn.bench.train.bench_rank`
over the job's default group, the same code as the local benchmark: the contenders of one length
alternate step by step, the step time is rank 0's clock after a global all-reduce, and every
rank's peak allocator bytes are recorded. Every byte between ranks of different nodes crosses the
shaped inter-node link (``tp`` and ``cp`` groups included: the mesh puts ``tp`` innermost, so a
``tp`` group of ``ranks_per_node`` ranks stays inside a node).
"""
from __future__ import annotations

import os
import time
from dataclasses import asdict, replace


def task_train(cfg: dict) -> dict:
    """Rank side: ``{"records": bench_rank(...)}`` for the points of ``cfg["bench"]``."""
    import torch.distributed as dist

    from ..bench.train import TrainBenchConfig, bench_rank, points

    values = dict(cfg["bench"])
    for key in ("seq_lens", "strategies", "fsdp", "mode_strategies"):
        values[key] = tuple(values[key])
    bench = replace(TrainBenchConfig(**values), world_size=dist.get_world_size())
    return {"records": bench_rank(dist.get_rank(), dist.get_world_size(), bench, points(bench))}


def run_train_cluster(bench, cluster: str, *, nodes: int = 2, ranks_per_node: int = 2,
                      timeout_s: float = 4 * 3600.0, say=print) -> dict:
    """Calibrate, bring ``cluster`` (a preset or spec) up, run :func:`task_train`, tear it down.

    Args:
        bench: a :class:`burstattn.bench.train.TrainBenchConfig` (its ``world_size`` is replaced by
            ``nodes * ranks_per_node``).

    Returns the benchmark document of :func:`burstattn.bench.train.run_train_bench` (``config``,
    ``records``, ...) plus ``spec`` (the links applied), ``requested`` and ``local_flops``."""
    from ..bench.timing import code_version, cpu_snapshot, machine_info, other_load
    from ..bench.train import combine
    from .launch import run_worker_task
    from .spec import calibrate, resolve

    world = nodes * ranks_per_node
    bench = replace(bench, world_size=world, threads=1)
    local = calibrate() * min(1.0, (os.cpu_count() or 1) / world)
    spec = resolve(cluster, nodes, ranks_per_node, local_flops=local)
    say(f"bench train --cluster: {spec.describe()}")
    cfg = dict(bench=asdict(bench), pg_timeout_s=1800, threads=1)
    before, t0 = cpu_snapshot(), time.perf_counter()
    ranks, applied = run_worker_task(spec, "train", cfg, timeout_s)
    per_rank = [r["records"] for r in ranks]
    return dict(config=asdict(bench), machine=machine_info(), code=code_version(), wall_s=time.perf_counter() - t0,
                other_load=other_load(before, cpu_snapshot()), records=combine(bench, per_rank),
                spec=asdict(applied), requested=asdict(spec), local_flops=local, cluster=cluster,
                date=time.strftime("%Y-%m-%dT%H:%M:%S%z"))

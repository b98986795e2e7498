"""``burstattn bench train --cluster PRESET``: training steps per strategy on an emulated cluster.

Like :mod:`.infer_bench`: the parent calibrates this machine, brings the cluster up (``nodes`` x
``ranks_per_node`` ranks, links scaled to the preset's compute-to-link ratio), runs ``python -m
bench.cluster.worker train`` under one multi-node ``torchrun`` agent per node, collects every
rank's records and tears the cluster down. Each rank runs :func:`bench.train.bench_rank`
over the job's default group, the same code as the local benchmark: the contenders of one length
alternate step by step, the step time is rank 0's clock after a global all-reduce, and every
rank's peak allocator bytes are recorded. Every byte between ranks of different nodes crosses the
shaped inter-node link (``tp`` and ``cp`` groups included: the mesh puts ``tp`` innermost, so a
``tp`` group of ``ranks_per_node`` ranks stays inside a node).
"""
from __future__ import annotations

import time
from dataclasses import asdict, replace


def task_train(cfg: dict) -> dict:
    """Rank side: ``{"records": bench_rank(...)}`` for the points of ``cfg["bench"]``."""
    import torch.distributed as dist

    from bench.train import bench_rank, config_from_dict, points

    bench = replace(config_from_dict(cfg["bench"]), world_size=dist.get_world_size())
    return {"records": bench_rank(dist.get_rank(), dist.get_world_size(), bench, points(bench))}


def run_train_cluster(bench, cluster: str, *, nodes: int = 2, ranks_per_node: int = 2,
                      timeout_s: float = 4 * 3600.0, say=print) -> dict:
    """Calibrate, bring ``cluster`` (a preset or spec) up, run :func:`task_train`, tear it down.

    Args:
        bench: a :class:`bench.train.TrainBenchConfig` (its ``world_size`` is replaced by
            ``nodes * ranks_per_node``).

    Returns the document of :func:`bench.train.document` plus ``spec`` (the links
    applied), ``links`` (their descriptions), ``requested``, ``local_flops``, ``cluster``, ``date``."""
    from bench.train import document, start
    from bench.cluster.launch import run_worker_task
    from bench.cluster.spec import rank_flops, resolve

    world = nodes * ranks_per_node
    bench = replace(bench, world_size=world, threads=1)
    local = rank_flops(world)
    spec = resolve(cluster, nodes, ranks_per_node, local_flops=local)
    say(f"bench train --cluster: {spec.describe()}")
    started = start()
    ranks, applied = run_worker_task(spec, "train", dict(bench=asdict(bench), pg_timeout_s=1800, threads=1), timeout_s)
    return document(bench, [r["records"] for r in ranks], started, "train-cluster", spec=asdict(applied),
                    links=dict(inter=applied.inter.describe(), intra=applied.intra.describe()), requested=asdict(spec),
                    local_flops=local, cluster=cluster, date=time.strftime("%Y-%m-%dT%H:%M:%S%z"))

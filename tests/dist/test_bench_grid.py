"""The benchmark harness: the torch.distributed byte meter (conventions, and agreement with
comm_stats for burstattn's strategies) and one grid point end to end (no peer library needed)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from bench.grid import GridPoint, grid_point, combine
from bench.report import correct


def _meter_conventions(rank: int, world: int) -> dict:
    from bench.distmeter import dist_meter

    x = torch.ones(world * 4, dtype=torch.float32)  # 16 * world bytes
    originals = (dist.all_reduce, dist.isend, dist.distributed_c10d.isend)
    with dist_meter() as m:
        dist.all_reduce(x.clone())
        dist.all_to_all_single(torch.empty_like(x), x)
        dist.all_gather_into_tensor(torch.empty(world * x.numel()), x)
        dist.reduce_scatter_tensor(torch.empty(4), x)
        ops = [dist.P2POp(dist.isend, x, (rank + 1) % world), dist.P2POp(dist.irecv, torch.empty_like(x), (rank - 1) % world)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        dist.broadcast(x, src=0)
    restored = originals == (dist.all_reduce, dist.isend, dist.distributed_c10d.isend)
    return {"ops": {k: v["sent"] for k, v in m.as_dict().items()}, "restored": restored}


def test_meter_conventions(pools):
    world = 2
    res = pools.get(world).run(_meter_conventions)
    b = 16 * world  # bytes of x
    for rank, r in enumerate(res):
        assert r["restored"]
        assert r["ops"] == {"all_reduce": b, "all_to_all_single": b // 2, "all_gather_into_tensor": b,
                            "reduce_scatter_tensor": b // 2, "batch_isend_irecv": b,
                            "broadcast": b if rank == 0 else 0}


@pytest.mark.parametrize("name,causal", [("burst", True), ("ring", False), ("ulysses", True), ("allgather", False),
                                         ("usp", True), ("tp", False), ("rsa", True), ("burst-distflash", True)])
def test_grid_point_ours(pools, name, causal):
    world = 2
    p = GridPoint(name, 256, causal, "float32", 4, 4, 16, 1, 1, 0, 128, 2)
    rec = combine(p, world, pools.get(world).run(grid_point, p, None))
    assert correct(rec), rec["errors"]
    assert rec["comm_stats_agrees"], rec["sent_bytes_per_rank"]
    assert rec["sent_bytes"]["fwd+bwd"] == rec["formula_bytes"]["fwd+bwd"]
    assert rec["peak_bytes"]["fwd+bwd"] > 0 and rec["median_s"]["fwd+bwd"] > 0

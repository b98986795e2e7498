"""The emulated-cluster testbed (root + network namespaces; skipped with the reason otherwise):
two namespaces as nodes joined by a shaped link, the real multi-node torchrun, one burst forward +
backward across them exact against float64, the link's byte counters against comm_stats(), a cut
link and a killed node surfacing as errors within the timeout, and a clean teardown."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from bench.cluster import netns
from bench.cluster.launch import ClusterJob, run_job
from bench.cluster.spec import ClusterSpec, Link, parse_link

REASON = netns.requirements_problem()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no emulated cluster here: {REASON}")
PREFIX = "btt"


@pytest.fixture
def cluster():
    netns.down(PREFIX)
    spec = netns.up(ClusterSpec(2, 1, inter=parse_link("200mbit"), intra=Link(None), prefix=PREFIX))
    yield spec
    netns.down(PREFIX)
    assert netns.existing(PREFIX) == [], "cluster down left something behind"


def _results(out: Path, world: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def test_burst_across_two_nodes_is_exact_and_bytes_match_the_link(cluster, tmp_path):
    cfg = dict(batch=1, seq_len=1024, heads=4, kv_heads=2, head_dim=32, causal=True, layout="zigzag", pg_timeout_s=60)
    results = run_job(cluster, ["-m", "bench.cluster.worker", "check", "--out", str(tmp_path),
                                "--config", json.dumps(cfg)], timeout_s=240)
    assert all(r.returncode == 0 for r in results), "\n".join(r.output[-2000:] for r in results)
    for r in _results(tmp_path, 2):
        assert r["ok"] and max(r["errors"].values()) < 1e-5, r
        # this node's link carried this rank's messages plus TCP/IP headers and the ACKs of what it
        # received (a few percent): the counter must be at least comm_stats and not much more
        assert r["sent"] > 0 and 1.0 <= r["iface"]["inter"] / r["sent"] <= 1.15, r


def _hold(cluster, tmp_path, fault, survivors=(0, 1)):
    cfg = dict(batch=1, seq_len=2048, heads=4, kv_heads=4, head_dim=32, seconds=90, pg_timeout_s=8,
               ready_dir=str(tmp_path / "ready"))
    job = ClusterJob(cluster, ["-m", "bench.cluster.worker", "hold", "--out", str(tmp_path / "out"),
                               "--config", json.dumps(cfg)])
    deadline = time.time() + 120
    while len(list((tmp_path / "ready").glob("rank*"))) < 2:
        assert time.time() < deadline, "ranks never started"
        time.sleep(0.2)
    time.sleep(1.0)  # a few calls in flight
    t_fault = time.time()
    fault(job)
    # the ranks must report within the timeout; then stop the agents (after a fault torchrun's agents
    # wait in their exit barrier for peers that are gone, as on a real cluster)
    limit = t_fault + cfg["pg_timeout_s"] + 20
    while time.time() < limit and not all((tmp_path / "out" / f"rank{r}.json").exists() for r in survivors):
        time.sleep(0.2)
    job.kill()
    return t_fault, cfg["pg_timeout_s"]


def test_cut_link_raises_on_every_rank_within_the_timeout(cluster, tmp_path):
    t_fault, timeout = _hold(cluster, tmp_path, lambda job: netns.set_link(cluster, 1, False))
    for rank in range(2):
        path = tmp_path / "out" / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} hung or died without reporting"
        r = json.loads(path.read_text())
        assert r["error_type"] is not None, r
        assert r["error_type"] in ("RingCommError", "CollectiveError") or "rank" in r["message"], r
        assert r["failed_at"] - t_fault < timeout + 20, (r["failed_at"] - t_fault, r)


def test_killed_node_makes_the_survivor_raise(cluster, tmp_path):
    t_fault, timeout = _hold(cluster, tmp_path, lambda job: job.kill_node(1), survivors=(0,))
    r = json.loads((tmp_path / "out" / "rank0.json").read_text())
    assert r["error_type"] is not None and r["failed_at"] - t_fault < timeout + 20, r


def test_cli_up_status_down_and_clear_refusals(capsys):
    from burstattn.cli import main

    netns.down("btc")
    try:
        assert main(["cluster", "up", "--nodes", "3", "--ranks-per-node", "2", "--inter", "10mbit",
                     "--intra", "100mbit", "--prefix", "btc"]) == 0
        assert "3 nodes x 2 ranks" in capsys.readouterr().out
        assert main(["cluster", "up", "--nodes", "2", "--inter", "10mbit", "--intra", "1gbit", "--prefix", "btc"]) == 2
        assert "is up" in capsys.readouterr().err
        assert main(["cluster", "status", "--prefix", "btc"]) == 0
        assert "inter 1.25 MB/s" in capsys.readouterr().out
    finally:
        assert main(["cluster", "down", "--prefix", "btc"]) == 0
    assert netns.existing("btc") == []
    assert main(["cluster", "down", "--prefix", "btc"]) == 0  # nothing up: still fine
    assert main(["cluster", "up", "--inter", "fast", "--intra", "1gbit", "--prefix", "btc"]) == 2
    assert "bandwidth must be a number with a unit" in capsys.readouterr().err
    if not netns.netem_available():
        assert main(["cluster", "up", "--inter", "10mbit,5ms", "--intra", "1gbit", "--prefix", "btc"]) == 2
        assert "netem" in capsys.readouterr().err
    assert netns.existing("btc") == []


def test_training_steps_across_two_nodes(cluster, tmp_path):
    """``bench train --cluster``'s worker task: training steps of the tiny model over the
    multi-node torchrun group (burst over cp = 2 nodes; FSDP too), one record per point on every rank."""
    from dataclasses import asdict

    from bench.train import TrainBenchConfig, combine

    bench = TrainBenchConfig(model="tiny", seq_lens=(128,), strategies=("burst",), fsdp=(False, True),
                             mode_strategies=(), repeats=1, world_size=2)
    cfg = dict(bench=asdict(bench), pg_timeout_s=60, threads=1)
    results = run_job(cluster, ["-m", "bench.cluster.worker", "train", "--out", str(tmp_path),
                                "--config", json.dumps(cfg)], timeout_s=300)
    assert all(r.returncode == 0 for r in results), "\n".join(r.output[-2000:] for r in results)
    ranks = _results(tmp_path, 2)
    assert all(r["ok"] for r in ranks), ranks
    records = combine(bench, [r["records"] for r in ranks])
    assert [(r["strategy"], r["fsdp"]) for r in records] == [("burst", False), ("burst", True)]
    for r in records:
        assert "error" not in r and r["tokens_per_s"] > 0 and min(r["peak_bytes_per_rank"]) > 0, r
        assert r["dims"]["cp"] == 2
    assert records[0]["loss"] == pytest.approx(records[1]["loss"], rel=1e-5)  # FSDP: the same model

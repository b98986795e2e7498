"""Launch a job on an emulated cluster with the real multi-node ``torchrun``.

One ``torchrun`` agent per node runs inside the node's namespace (``ip netns exec``), with c10d
rendezvous on node 0's address, ``--local-addr`` set to the node's own address and
``GLOO_SOCKET_IFNAME=btnet0``, exactly as on a multi-node cluster: the agents meet over the
emulated network, and every byte between ranks crosses the shaped links.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from bench.cluster.netns import IFNAME, kill_processes
from bench.cluster.spec import ClusterSpec


@dataclass
class NodeResult:
    node: int
    returncode: Optional[int]  # None: killed at the timeout
    output: str


def python_path() -> str:
    """``PYTHONPATH`` of the ranks: the checkout holding ``bench`` first (the worker is ``-m bench.cluster.worker``
    and ``bench`` is not installed), then the caller's."""
    root = str(Path(__file__).resolve().parents[2])
    return os.pathsep.join([root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])


def torchrun_command(spec: ClusterSpec, node: int, args: Sequence[str], port: int = 29400,
                     rdzv_id: Optional[str] = None, env: Optional[dict] = None) -> list[str]:
    """The command that starts node ``node``'s torchrun agent inside its namespace."""
    extra_env = {"GLOO_SOCKET_IFNAME": IFNAME, "OMP_NUM_THREADS": "1", "PYTHONPATH": python_path(), **(env or {})}
    return (["ip", "netns", "exec", spec.namespace(node), "env"] + [f"{k}={v}" for k, v in extra_env.items()]
            + [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(spec.nodes),
               "--nproc-per-node", str(spec.ranks_per_node), "--node-rank", str(node),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{spec.address(0)}:{port}",
               "--rdzv-id", rdzv_id or "burstattn", "--local-addr", spec.address(node),
               # node 0 hosts the rendezvous store: say so (torchrun cannot tell from the hostname,
               # which every namespace shares)
               "--rdzv-conf", f"is_host={'true' if node == 0 else 'false'}",
               "--max-restarts", "0", "--monitor-interval", "0.2"] + list(args))


class ClusterJob:
    """The torchrun agents of one job, one per node (started on construction)."""

    def __init__(self, spec: ClusterSpec, args: Sequence[str], env: Optional[dict] = None,
                 port: int = 29400) -> None:
        self.spec = spec
        rdzv = uuid.uuid4().hex[:12]
        self.procs = []
        for node in range(spec.nodes):
            cmd = torchrun_command(spec, node, args, port=port, rdzv_id=rdzv, env=env)
            self.procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                               cwd=os.getcwd()))

    def kill_node(self, node: int) -> None:
        """SIGKILL node ``node``'s agent and its workers (a node crash)."""
        kill_processes(self.spec.namespace(node))

    def kill(self) -> list[NodeResult]:
        """Kill every node's agent and workers now (after a fault the agents wait in torchrun's exit
        barrier for peers that are gone); their output so far."""
        return self.wait(0.0)

    def wait(self, timeout_s: float) -> list[NodeResult]:
        """Wait for every agent (killing the rest at the timeout); their exit codes and output."""
        deadline = time.monotonic() + timeout_s
        results = []
        for node, proc in enumerate(self.procs):
            try:
                out, _ = proc.communicate(timeout=max(deadline - time.monotonic(), 0.1))
                results.append(NodeResult(node, proc.returncode, out))
            except subprocess.TimeoutExpired:
                self.kill_node(node)
                proc.kill()
                out, _ = proc.communicate()
                results.append(NodeResult(node, None, out))
        return results


def run_job(spec: ClusterSpec, args: Sequence[str], timeout_s: float, env: Optional[dict] = None) -> list[NodeResult]:
    """Start a job and wait for it; see :class:`ClusterJob`."""
    return ClusterJob(spec, args, env=env).wait(timeout_s)


def run_worker_task(spec: ClusterSpec, task: str, cfg: dict, timeout_s: float = 3600) -> tuple[list[dict], ClusterSpec]:
    """Bring ``spec`` up, run ``python -m bench.cluster.worker TASK`` on every node with ``cfg``
    (JSON), collect each rank's result file, tear the cluster down (always). Returns the per-rank
    results (rank order) and the spec actually applied (latencies dropped where the kernel has no
    netem). Raises ``RuntimeError`` naming the first rank that wrote nothing or failed."""
    import json
    import tempfile
    from pathlib import Path

    from bench.cluster import netns

    applied = netns.up(spec, allow_no_latency=True)
    try:
        with tempfile.TemporaryDirectory(prefix=f"burstattn-{task}-") as out:
            results = run_job(applied, ["-m", "bench.cluster.worker", task, "--out", out,
                                        "--config", json.dumps(cfg)], timeout_s=timeout_s)
            ranks = []
            for r in range(applied.world_size):
                path = Path(out) / f"rank{r}.json"
                if not path.exists():
                    tail = "\n".join(res.output[-3000:] for res in results)
                    raise RuntimeError(f"rank {r} wrote no result; agents' output:\n{tail}")
                ranks.append(json.loads(path.read_text()))
    finally:
        netns.down(spec.prefix)
    bad = [r for r in ranks if not r.get("ok")]
    if bad:
        raise RuntimeError(f"rank {bad[0]['rank']} failed: {bad[0].get('traceback')}")
    return ranks, applied

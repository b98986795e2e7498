"""Bring an emulated cluster up and down with network namespaces, veth pairs, a bridge and ``tc``.

Topology for a :class:`~.spec.ClusterSpec` with prefix ``bt``:

* a bridge ``bt-br`` in the root namespace (no address: the cluster's subnet is reachable only
  from inside the node namespaces);
* node i: namespace ``bt-n{i}`` holding one end of a veth pair, renamed ``btnet0`` (the same name
  in every node, for ``GLOO_SOCKET_IFNAME``), address ``{subnet}.{i+1}/24``; the other end,
  ``bt-h{i}``, is a port of the bridge;
* inter-node shaping: a token bucket (``tbf``) at the ``inter`` rate on ``btnet0`` (traffic
  leaving the node) and on ``bt-h{i}`` (traffic entering it), so each node's link is shaped in
  both directions; ``netem`` adds the latency where the kernel has it;
* intra-node shaping: the same on the node's ``lo``: ranks of one node reach each other's
  ``btnet0`` address through ``lo``, so the ``intra`` rate is the node's internal fabric (shared
  by its ranks, like a PCIe switch).

Every name starts with the prefix, so :func:`down` finds everything again after a crash
(namespaces, links, and the processes still running inside the namespaces). The cluster's
description is written to a state file so that later commands (``bench --cluster``, tests) find it.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from bench.cluster.spec import ClusterSpec, Link, without_latency

IFNAME = "btnet0"
STATE_DIR = Path(os.environ.get("BURSTATTN_CLUSTER_STATE", "/run/burstattn"))


class ClusterError(RuntimeError):
    """The cluster cannot be created here (no root, no iproute2, no netns) or a command failed."""


def _run(*cmd: str, ns: Optional[str] = None, check: bool = True) -> subprocess.CompletedProcess:
    full = (["ip", "netns", "exec", ns] if ns else []) + list(cmd)
    res = subprocess.run(full, capture_output=True, text=True)
    if check and res.returncode != 0:
        raise ClusterError(f"command failed ({res.returncode}): {' '.join(full)}: {res.stderr.strip()}")
    return res


def requirements_problem() -> Optional[str]:
    """Why an emulated cluster cannot be created on this machine, or ``None``."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return "emulated clusters need Linux network namespaces"
    if os.geteuid() != 0:
        return "burstattn cluster needs root (network namespaces, veth links and tc); run it as root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"burstattn cluster needs iproute2 ('{tool}' not found): apt-get install iproute2"
    probe = "btprobe"
    res = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if res.returncode != 0:
        return f"cannot create network namespaces here (ip netns add: {res.stderr.strip()})"
    try:
        for what, cmd in (("veth links", ["ip", "link", "add", "btpa", "type", "veth", "peer", "name", "btpb"]),
                          ("tbf shaping", ["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", "1mbit",
                                           "burst", "64kb", "limit", "1mb"])):
            res = _run(*cmd, ns=probe, check=False)
            if res.returncode != 0:
                return f"cannot create {what} here ({' '.join(cmd)}: {res.stderr.strip()})"
        return None
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)


def netem_available() -> bool:
    """Whether the kernel has the netem qdisc (latency emulation)."""
    ns = "btnetem"
    subprocess.run(["ip", "netns", "add", ns], capture_output=True)
    try:
        _run("ip", "link", "set", "lo", "up", ns=ns)
        res = _run("tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms", ns=ns, check=False)
        return res.returncode == 0
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _shape(dev: str, link: Link, ns: Optional[str]) -> None:
    """tbf (and netem for latency) as the root qdisc of ``dev``."""
    if link.bandwidth is None and not link.latency_ms:
        return
    parent = ["root"]
    if link.latency_ms:
        _run("tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay", f"{link.latency_ms}ms",
             "limit", "100000", ns=ns)
        parent = ["parent", "1:1"]
    if link.bandwidth is not None:
        rate = int(link.bandwidth)  # bytes/s; tc's "bps" is bytes per second
        burst = max(rate // 50, 256 * 1024)  # >= GSO segments (64 KiB) with room; 20 ms at the rate
        limit = burst + rate  # a second of queue: TCP backs off long before drops
        _run("tc", "qdisc", "add", "dev", dev, *parent, "handle", "10:", "tbf", "rate", f"{rate}bps",
             "burst", str(burst), "limit", str(limit), ns=ns)


def state_path(prefix: str) -> Path:
    return STATE_DIR / f"{prefix}.json"


def up(spec: ClusterSpec, allow_no_latency: bool = False) -> ClusterSpec:
    """Create the cluster (see the module docstring); returns the spec actually applied.

    Raises :class:`ClusterError` if the machine cannot (naming what is missing), if a cluster with
    this prefix exists, or if latency is asked for without netem (unless ``allow_no_latency``,
    which drops the latencies and says so in the returned spec's name).
    """
    problem = requirements_problem()
    if problem:
        raise ClusterError(problem)
    if existing(spec.prefix):
        raise ClusterError(f"a cluster with prefix {spec.prefix!r} is up; run 'burstattn cluster down "
                           f"--prefix {spec.prefix}' first")
    if (spec.inter.latency_ms or spec.intra.latency_ms) and not netem_available():
        if not allow_no_latency:
            raise ClusterError("link latency needs the netem qdisc (sch_netem), which this kernel does not have; "
                               "give bandwidths only")
        spec = without_latency(spec)
    p = spec.prefix
    try:
        _run("ip", "link", "add", f"{p}-br", "type", "bridge")
        _run("ip", "link", "set", f"{p}-br", "up")
        for i in range(spec.nodes):
            ns, host = spec.namespace(i), f"{p}-h{i}"
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", host, "type", "veth", "peer", "name", f"{p}-e{i}")
            _run("ip", "link", "set", f"{p}-e{i}", "netns", ns)
            _run("ip", "link", "set", f"{p}-e{i}", "name", IFNAME, ns=ns)
            _run("ip", "link", "set", host, "master", f"{p}-br")
            _run("ip", "link", "set", host, "up")
            _run("ip", "addr", "add", f"{spec.address(i)}/24", "dev", IFNAME, ns=ns)
            _run("ip", "link", "set", IFNAME, "up", ns=ns)
            _run("ip", "link", "set", "lo", "up", ns=ns)
            _shape(IFNAME, spec.inter, ns)
            _shape(host, spec.inter, None)
            _shape("lo", spec.intra, ns)
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        state_path(p).write_text(json.dumps(asdict(spec)))
    except Exception:
        down(p)
        raise
    return spec


def existing(prefix: str) -> list[str]:
    """Namespaces and links of a cluster with this prefix that exist now."""
    names = []
    res = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    names += [line.split()[0] for line in res.stdout.splitlines() if line.startswith(f"{prefix}-n")]
    res = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True)
    for line in res.stdout.splitlines():
        parts = line.split(":")
        if len(parts) > 1:
            name = parts[1].strip().split("@")[0]
            if name.startswith(f"{prefix}-"):
                names.append(name)
    return names


def kill_processes(namespace: str) -> None:
    """SIGKILL every process running inside ``namespace`` (a crashed node, or leftovers)."""
    pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), 9)
        except (ProcessLookupError, ValueError):
            pass


def down(prefix: str = "bt") -> list[str]:
    """Remove everything of the cluster ``prefix`` (kills processes left in its namespaces); never
    raises for what is already gone. Returns what it removed."""
    removed = []
    for name in existing(prefix):
        if name.startswith(f"{prefix}-n"):
            kill_processes(name)
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        else:
            subprocess.run(["ip", "link", "del", name], capture_output=True)
        removed.append(name)
    try:
        state_path(prefix).unlink()
    except FileNotFoundError:
        pass
    return removed


def load(prefix: str = "bt") -> ClusterSpec:
    """The spec of the cluster that is up with this prefix (from its state file)."""
    try:
        data = json.loads(state_path(prefix).read_text())
    except FileNotFoundError as e:
        raise ClusterError(f"no cluster with prefix {prefix!r} is up ('burstattn cluster up' first)") from e
    data["inter"], data["intra"] = Link(**data["inter"]), Link(**data["intra"])
    return ClusterSpec(**data)


def counters(spec: ClusterSpec) -> dict[int, dict[str, int]]:
    """Bytes sent so far per node: ``{node: {"inter": btnet0 tx, "intra": lo tx}}``."""
    out = {}
    for i in range(spec.nodes):
        res = _run("ip", "-j", "-s", "link", "show", ns=spec.namespace(i))
        stats = {d["ifname"]: d["stats64"]["tx"]["bytes"] for d in json.loads(res.stdout)}
        out[i] = {"inter": stats.get(IFNAME, 0), "intra": stats.get("lo", 0)}
    return out


def set_link(spec: ClusterSpec, node: int, up_: bool) -> None:
    """Cut (``up_=False``) or restore node ``node``'s link to the bridge."""
    _run("ip", "link", "set", f"{spec.prefix}-h{node}", "up" if up_ else "down")


def iface_tx() -> dict[str, int]:
    """Bytes this node's interfaces sent so far (this process is inside the node's namespace)."""
    out = {}
    for kind, dev in (("inter", IFNAME), ("intra", "lo")):
        try:
            out[kind] = int(Path(f"/sys/class/net/{dev}/statistics/tx_bytes").read_text())
        except OSError:
            out[kind] = -1
    return out

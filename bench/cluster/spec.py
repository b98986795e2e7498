"""What an emulated cluster is: nodes, ranks per node, and two levels of links (pure).

A link is a bandwidth (bytes per second) and a one-way latency. Inside a node ranks talk over the
``intra`` link, between nodes over the ``inter`` link. Presets reproduce the compute-to-bandwidth
ratio of real clusters on this machine: a link of the real cluster that moves ``B`` bytes/s next to a
GPU that computes attention at ``F`` FLOP/s becomes a link of ``B * f / F`` bytes/s next to a CPU
core that computes at ``f`` FLOP/s (measured by :func:`rank_flops`), and latencies stretch by
``F / f``, so every strategy meets the same regime (compute-bound, or communication-bound) as on
the real hardware.
"""
from __future__ import annotations

import re
import os
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Optional

import torch

from burstattn.sim.hardware import emulation_figures

_UNITS = {"bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "b": 1, "kb": 1e3, "mb": 1e6,
          "gb": 1e9, "bps": 1 / 8, "kbps": 1e3 / 8, "mbps": 1e6 / 8, "gbps": 1e9 / 8}


@dataclass(frozen=True)
class Link:
    """A shaped link: ``bandwidth`` in bytes/s (``None``: unshaped), ``latency_ms`` one-way."""

    bandwidth: Optional[float]
    latency_ms: float = 0.0

    def describe(self) -> str:
        bw = "unshaped" if self.bandwidth is None else f"{self.bandwidth / 1e6:.3g} MB/s"
        return bw + (f", {self.latency_ms:g} ms" if self.latency_ms else "")


def parse_link(text: str) -> Link:
    """``"BANDWIDTH[,LATENCY]"``: bandwidth as ``10mbit``, ``2MB`` (per second), ``8gbit`` or
    ``none``; latency as ``5ms``, ``200us`` or a number of ms. Raises ``ValueError`` naming the
    part that does not parse."""
    parts = [p.strip() for p in str(text).split(",")]
    if len(parts) not in (1, 2) or not parts[0]:
        raise ValueError(f"link must be BANDWIDTH[,LATENCY] (e.g. 10mbit,2ms), got {text!r}")
    bw_text = parts[0].lower().removesuffix("/s")
    if bw_text in ("none", "unshaped", "inf"):
        bandwidth = None
    else:
        m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([a-z]+)", bw_text)
        if not m or m.group(2) not in _UNITS:
            raise ValueError(f"bandwidth must be a number with a unit in {sorted(_UNITS)} (per second), got "
                             f"{parts[0]!r}")
        bandwidth = float(m.group(1)) * _UNITS[m.group(2)]
        if bandwidth <= 0:
            raise ValueError(f"bandwidth must be positive, got {parts[0]!r}")
    latency = 0.0
    if len(parts) == 2:
        m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*(ms|us|s)?", parts[1].lower())
        if not m:
            raise ValueError(f"latency must look like 5ms, 200us or 0.01s, got {parts[1]!r}")
        latency = float(m.group(1)) * {"ms": 1.0, "us": 1e-3, "s": 1e3, None: 1.0}[m.group(2)]
    return Link(bandwidth, latency)


@dataclass(frozen=True)
class ClusterSpec:
    """An emulated cluster: ``nodes`` network namespaces of ``ranks_per_node`` ranks each."""

    nodes: int
    ranks_per_node: int
    inter: Link
    intra: Link
    name: str = "custom"
    prefix: str = "bt"           # every namespace / link / bridge name starts with it
    subnet: str = "10.213.77"    # /24 used only inside the namespaces: node i is .(i+1)

    def __post_init__(self) -> None:
        for field_name in ("nodes", "ranks_per_node"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{field_name} must be a positive int, got {value!r}")
        if self.nodes > 200:
            raise ValueError(f"nodes must be <= 200 (one /24), got {self.nodes}")
        if not re.fullmatch(r"[a-z][a-z0-9]{0,5}", self.prefix):
            raise ValueError(f"prefix must be 1-6 lowercase letters/digits starting with a letter, got {self.prefix!r}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def node_of(self, rank: int) -> int:
        """The node of a global rank (torchrun numbers ranks node by node)."""
        return rank // self.ranks_per_node

    def address(self, node: int) -> str:
        return f"{self.subnet}.{node + 1}"

    def namespace(self, node: int) -> str:
        return f"{self.prefix}-n{node}"

    def describe(self) -> str:
        return (f"{self.name}: {self.nodes} nodes x {self.ranks_per_node} ranks, inter {self.inter.describe()}, "
                f"intra {self.intra.describe()}")


# Real clusters: attention throughput per GPU (FLOP/s) and links per GPU (bytes/s, one way, seconds);
# one definition with the simulator's presets (burstattn.sim.hardware, sources beside every figure)
REAL = MappingProxyType({name: emulation_figures(name) for name in ("a100-pcie-roce", "h100-nvlink-ib")})


def rank_flops(world: int, seconds: float = 1.0) -> float:
    """Attention FLOP/s each of ``world`` local ranks computes: this machine's kernel on one thread
    (:func:`burstattn.sim.calibrate.forward_rate`: 8 heads, 1024 x 1024, d = 64, float32), shared
    out when the ranks outnumber the cores."""
    from burstattn.sim.calibrate import forward_rate

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        per_core = forward_rate(seconds)
    finally:
        torch.set_num_threads(old)
    return per_core * min(1.0, (os.cpu_count() or 1) / world)


def preset(name: str, nodes: int, ranks_per_node: int, local_flops: float) -> ClusterSpec:
    """A cluster with the compute-to-link ratios of the real cluster ``name`` (:data:`REAL`) on a
    machine whose kernel computes ``local_flops`` FLOP/s per rank."""
    if name not in REAL:
        raise ValueError(f"unknown preset {name!r}; presets: {sorted(REAL)}")
    r = REAL[name]
    scale = local_flops / r["flops"]  # < 1: everything is slower here, links shrink alike
    stretch = 1e3 / scale             # seconds on the real cluster -> ms here
    return ClusterSpec(nodes, ranks_per_node, inter=Link(r["inter"] * scale, r["inter_lat"] * stretch),
                       intra=Link(r["intra"] * scale, r["intra_lat"] * stretch), name=name)


def resolve(text: str, nodes: int, ranks_per_node: int, local_flops: Optional[float] = None) -> ClusterSpec:
    """A preset name, ``"inter=BW[,LAT];intra=BW[,LAT]"`` or a ``.json`` spec file from ``burstattn sim
    calibrate`` (its links; ``nodes`` and ``ranks_per_node`` as given here), as a :class:`ClusterSpec`."""
    if text.endswith(".json"):
        spec = from_file(text)
        return replace(spec, nodes=nodes, ranks_per_node=ranks_per_node)
    if text in REAL:
        return preset(text, nodes, ranks_per_node,
                      local_flops if local_flops is not None else rank_flops(nodes * ranks_per_node))
    fields = dict(part.split("=", 1) for part in text.split(";") if "=" in part)
    if set(fields) != {"inter", "intra"}:
        raise ValueError(f"cluster must be a preset {sorted(REAL)} or 'inter=BW[,LAT];intra=BW[,LAT]', got {text!r}")
    return ClusterSpec(nodes, ranks_per_node, parse_link(fields["inter"]), parse_link(fields["intra"]))


def without_latency(spec: ClusterSpec) -> ClusterSpec:
    """The same cluster with latencies dropped (when the kernel has no netem)."""
    return replace(spec, inter=Link(spec.inter.bandwidth), intra=Link(spec.intra.bandwidth))


def ring_schedule(spec: ClusterSpec) -> str:
    """The burst schedule this cluster calls for: ``"double"`` (two-level ring, most traffic inside
    nodes) when there are several nodes of several ranks and the intra-node link is faster than the
    inter-node one (NVLink + InfiniBand), else ``"ring"`` (A100s on PCIe without P2P behind RoCE: the
    node's internal path is the slower one, and the flat ring puts less on it)."""
    if spec.nodes < 2 or spec.ranks_per_node < 2:
        return "ring"
    intra = float("inf") if spec.intra.bandwidth is None else spec.intra.bandwidth
    inter = float("inf") if spec.inter.bandwidth is None else spec.inter.bandwidth
    return "double" if intra > inter else "ring"


def from_file(path: str, prefix: str = "bt") -> ClusterSpec:
    """The emulated cluster of a spec file written by ``burstattn sim calibrate`` (its
    ``"cluster"`` object: nodes, ranks_per_node, inter and intra as ``BANDWIDTH[,LATENCY]``)."""
    import json

    try:
        c = json.loads(open(path).read())["cluster"]
        return ClusterSpec(int(c["nodes"]), int(c["ranks_per_node"]), parse_link(c["inter"]), parse_link(c["intra"]),
                           name=c.get("name", "calibrated"), prefix=prefix)
    except (OSError, KeyError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"--cluster-spec {path}: not a cluster spec from `burstattn sim calibrate` ({e})") from None

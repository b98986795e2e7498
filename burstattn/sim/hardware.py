"""Cluster specs for the simulator: devices, links and their published figures (pure).

A :class:`ClusterHW` is what the simulator needs to know about a cluster: devices per node, the
per-device matmul rate and attention-kernel efficiencies (forward and backward separately), memory
bandwidth and capacity, and two levels of links (inside a node, between nodes), each a bandwidth in
bytes/s per direction and a one-way latency in seconds, either per device (NVLink ports, one NIC
per GPU) or shared by the node (one NIC per node; the emulated cluster's loopback).

Every figure of a preset has its source beside it in ``sources`` (``burstattn sim --cluster NAME
--json`` prints them). ``a100-pcie-roce`` and ``h100-nvlink-ib`` are also the presets of ``burstattn
cluster``: :func:`emulation_figures` is the one definition :mod:`bench.cluster.spec` reads.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from types import MappingProxyType
from typing import Mapping, Optional


@dataclass(frozen=True)
class ClusterHW:
    """One cluster, as the simulator sees it (rates in FLOP/s, bytes/s; latencies in s)."""

    name: str
    devices_per_node: int
    """GPUs (chips) in one node; ranks are numbered node by node."""
    peak_flops: float
    """Dense bf16/fp16 FLOP/s of one device (vendor figure)."""
    matmul_eff: float
    """Achieved fraction of ``peak_flops`` for large GEMMs (projections, MLP)."""
    attn_fwd_eff: float
    """Achieved fraction of ``peak_flops`` of the attention kernel's forward (non-causal block)."""
    attn_bwd_eff: float
    """Same for the backward (FLOPs counted as 2.5x the forward's)."""
    causal_eff: float
    """Efficiency multiplier of a causal (diagonal) block relative to a full one."""
    mem_bw: float
    """Device memory bandwidth, bytes/s (element-wise work: merges, accumulators, decode)."""
    mem_bytes: float
    """Device memory capacity, bytes."""
    intra_bw: float
    """Intra-node link, bytes/s per direction (per device, or per node if ``intra_shared``)."""
    intra_lat: float
    inter_bw: float
    """Inter-node network, bytes/s per direction (per device, or per node if ``inter_shared``)."""
    inter_lat: float
    intra_shared: bool = False
    inter_shared: bool = False
    kernel_overhead_s: float = 5e-6
    """Fixed cost of one kernel call (launch, tile setup)."""
    plain_attn_rates: Optional[tuple] = None
    """Score entries/s (forward, backward) of attention built from plain matmuls with the scores
    materialised (Ring Self-Attention); ``None``: matmuls at ``matmul_rate`` plus the score passes
    at ``mem_bw`` (4 bytes read and written per entry and pass)."""
    emulated_attn_flops: Optional[float] = None
    """The attention rate ``burstattn cluster`` scales this cluster's links by (its presets only)."""
    host_bw: float = 25e9
    """Host link of one device (PCIe to the CPU's memory), bytes/s per direction: what offloaded
    activations move over."""
    host_mem_bytes: float = 128e9
    """Host memory one device may fill with offloaded activations (the node's memory / its devices)."""
    fp32_flops: Optional[float] = None
    """Dense float32 FLOP/s of one device (``--dtype float32``; ``None``: ``peak_flops``, as for a
    spec from ``sim calibrate``, which measures float32)."""
    host_is_device: bool = False
    """The device memory IS the host memory (a CPU, as ``sim calibrate`` measures): offloading
    activations frees nothing, so the planner does not offer it and the memory model counts offloaded
    tensors where they were."""
    chunk_overhead_s: Optional[float] = None
    """Fixed cost of one blockwise chunk (MLP or loss), forward and backward, beyond its FLOPs and
    weight reads: its kernel launches and dispatch (``None``: :data:`CHUNK_KERNELS` x
    ``kernel_overhead_s``); measured by ``sim calibrate`` (bench/results/simulation.md)."""
    host_adam_bw: float = 25e9
    """Host-memory bytes/s one device's share of the CPUs sustains in AdamW (``--offload-optimizer``:
    28 bytes per parameter, :mod:`burstattn.sim.offload`)."""
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("name", "sources", "emulated_attn_flops", "intra_shared", "inter_shared",
                          "plain_attn_rates", "fp32_flops", "host_is_device", "chunk_overhead_s"):
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (
                    value == 0 and f.name not in ("intra_lat", "inter_lat", "kernel_overhead_s")):
                raise ValueError(f"ClusterHW.{f.name} must be a positive number, got {value!r}")
        if not isinstance(self.devices_per_node, int) or self.devices_per_node < 1:
            raise ValueError(f"ClusterHW.devices_per_node must be a positive int, got {self.devices_per_node!r}")

    @property
    def chunk_cost_s(self) -> float:
        """Fixed seconds of one blockwise chunk, forward and backward (:attr:`chunk_overhead_s`)."""
        return self.chunk_overhead_s if self.chunk_overhead_s is not None else CHUNK_KERNELS * self.kernel_overhead_s

    def for_dtype(self, float32: bool) -> "ClusterHW":
        """The spec that prices a float32 run (``peak_flops`` = :attr:`fp32_flops` where given), else itself."""
        if not float32 or self.fp32_flops is None:
            return self
        return replace(self, peak_flops=self.fp32_flops)

    def attn_rate(self, backward: bool) -> float:
        """Achieved attention FLOP/s (forward or backward)."""
        return self.peak_flops * (self.attn_bwd_eff if backward else self.attn_fwd_eff)

    @property
    def matmul_rate(self) -> float:
        return self.peak_flops * self.matmul_eff

    def with_overrides(self, **values) -> "ClusterHW":
        """A copy with fields replaced (``inter_gbps=``/``intra_gbps=`` in Gbit/s, ``gpu_tflops=``,
        ``gpu_mem_gib=`` are accepted too). Unknown names raise ``ValueError``."""
        units = {"inter_gbps": ("inter_bw", 1e9 / 8), "intra_gbps": ("intra_bw", 1e9 / 8),
                 "gpu_tflops": ("peak_flops", 1e12), "gpu_mem_gib": ("mem_bytes", 2**30)}
        out = {}
        for key, value in values.items():
            if value is None:
                continue
            if key in units:
                name, scale = units[key]
                out[name] = float(value) * scale
            elif key in {f.name for f in fields(self)}:
                out[key] = value
            else:
                raise ValueError(f"unknown cluster field {key!r}; known: {sorted({f.name for f in fields(self)} | set(units))}")
        note = {k: "overridden on the command line" for k in out}
        return replace(self, **out, sources={**self.sources, **note}) if out else self

    def to_dict(self) -> dict:
        d = asdict(self)
        d["sources"] = dict(self.sources)
        return d


CHUNK_KERNELS = 30
"""Kernels one blockwise chunk launches, forward + backward + the recomputed forward (counted on
``burstattn.models.blockwise``: an MLP chunk's norm, three matmuls, SiLU and product forward (about
8), twice that backward, the forward again; a loss chunk's norm, head, log-softmax, gather about as
many): the presets' per-chunk cost is this times ``kernel_overhead_s`` (derived, not measured)."""
_FP32 = "datasheet dense FP32 (no tensor cores; PyTorch's default float32 matmul precision)"
_A100_FA2 = "FlashAttention-2 paper, A100 80GB SXM4, head_dim 128 at 16K"
_PCIE4 = ("PCIe 4.0 x16 per GPU: 31.5 GB/s raw per direction; 22 GB/s achieved (the 22-26 GB/s commonly measured "
          "for pinned host copies; not measured here)")
_PCIE5 = ("PCIe 5.0 x16 per GPU: 63 GB/s raw per direction; 50 GB/s achieved (assumption: the same 80% of raw "
          "as PCIe 4.0's pinned copies)")
_ADAM = ("; AdamW on the CPU at half of that (assumption: PyTorch's foreach AdamW makes several passes over "
         "float32 arrays, not one STREAM-like pass; not measured on such a host)")
_ADAM_H100 = ("NVIDIA DGX H100 datasheet: 2 x Xeon Platinum 8480C; Intel: 8 channels DDR5-4800 per socket = 307.2 GB/s, "
              "614.4 GB/s per node, 76.8 GB/s per GPU" + _ADAM)
_ADAM_A100 = ("NVIDIA DGX A100 datasheet: 2 x AMD EPYC 7742; AMD: 8 channels DDR4-3200 per socket = 204.8 GB/s, "
              "409.6 GB/s per node, 51.2 GB/s per GPU" + _ADAM)
_PRESETS = (
    ClusterHW(
        "a100-pcie-roce", 8, 312e12, 0.72, 0.71, 0.63, 0.88, 1.935e12, 80e9,
        intra_bw=12e9, intra_lat=10e-6, inter_bw=25e9, inter_lat=5e-6, inter_shared=True,
        emulated_attn_flops=300e12, host_bw=22e9, host_mem_bytes=1e12 / 8, fp32_flops=19.5e12, host_adam_bw=0.5 * 409.6e9 / 8,
        sources={"fp32_flops": f"A100 {_FP32}: 19.5 TFLOP/s",
                 "host_adam_bw": _ADAM_A100 + " (assumed: a DGX A100-like host)",
            "host_bw": _PCIE4, "host_mem_bytes": "assumption: 1 TB of host memory per 8-GPU node (as a DGX A100)",
            "devices_per_node": "BurstAttention's testbed: 8 x A100 80GB PCIe per node",
            "peak_flops": "NVIDIA A100 datasheet: 312 TFLOP/s dense bf16",
            "matmul_eff": "FA2 paper: GPT training end to end 225 TFLOP/s per A100 (72% MFU)",
            "attn_fwd_eff": f"{_A100_FA2}: forward 223 TFLOP/s non-causal (0.71 of peak)",
            "attn_bwd_eff": f"{_A100_FA2}: fwd+bwd 203 TFLOP/s -> backward 0.63 of peak",
            "causal_eff": f"{_A100_FA2}: causal forward 197 vs 223 TFLOP/s",
            "mem_bw": "A100 80GB PCIe datasheet: 1,935 GB/s", "mem_bytes": "80 GB",
            "intra_bw": "PCIe 4.0 x16 31.5 GB/s raw per direction; without P2P every copy goes through host "
                        "memory twice: 12 GB/s per GPU (burstattn cluster's figure)",
            "intra_lat": "burstattn cluster's figure (host bounce)", "inter_lat": "burstattn cluster's figure",
            "inter_bw": "200 Gb/s RoCE (BurstAttention's rebuttal; the latest version says 600 Gb/s) = 25 GB/s, "
                        "modelled as one NIC per node",
            "emulated_attn_flops": "burstattn cluster's attention rate for this preset (since 04c5633)"}),
    ClusterHW(
        "a100-nvlink-ib", 8, 312e12, 0.72, 0.71, 0.63, 0.88, 2.039e12, 80e9,
        intra_bw=240e9, intra_lat=3e-6, inter_bw=12.5e9 * 0.9, inter_lat=5e-6, inter_shared=True,
        host_bw=22e9, host_mem_bytes=1e12 / 8, fp32_flops=19.5e12, host_adam_bw=0.5 * 409.6e9 / 8,
        sources={"fp32_flops": f"A100 {_FP32}: 19.5 TFLOP/s",
                 "host_adam_bw": _ADAM_A100,
            "host_bw": _PCIE4, "host_mem_bytes": "NVIDIA DGX A100 datasheet: 1 TB system memory (2 TB on the 640GB "
                                                 "model) for 8 GPUs",
            "devices_per_node": "DGX A100 (DistFlashAttn's setup)",
            "peak_flops": "A100 datasheet 312 TFLOP/s", "matmul_eff": "FA2 paper: 72% MFU",
            "attn_fwd_eff": _A100_FA2, "attn_bwd_eff": _A100_FA2, "causal_eff": _A100_FA2,
            "mem_bw": "A100 80GB SXM datasheet: 2,039 GB/s", "mem_bytes": "80 GB",
            "intra_bw": "NVLink3 300 GB/s per direction; nccl-tests 8xA100 all-reduce bus bandwidth 200-232 GB/s "
                        "(NVIDIA/nccl-tests #149): 240 GB/s",
            "intra_lat": "assumption: a few us per NVLink hop",
            "inter_bw": "100 Gb/s InfiniBand per node (DistFlashAttn) = 12.5 GB/s at 0.9 efficiency (Calculon)",
            "inter_lat": "assumption: 5 us (RDMA)"}),
    ClusterHW(
        "h100-nvlink-ib", 8, 989e12, 0.60, 0.55, 0.45, 0.88, 3.35e12, 80e9,
        intra_bw=450e9, intra_lat=2e-6, inter_bw=50e9, inter_lat=5e-6, emulated_attn_flops=700e12,
        host_bw=50e9, host_mem_bytes=2e12 / 8, fp32_flops=67e12, host_adam_bw=0.5 * 614.4e9 / 8,
        sources={"fp32_flops": f"H100 SXM {_FP32}: 67 TFLOP/s",
                 "host_adam_bw": _ADAM_H100,
            "host_bw": _PCIE5, "host_mem_bytes": "NVIDIA DGX H100 datasheet: 2 TB system memory for 8 GPUs",
            "devices_per_node": "DGX H100 / Meta's CP-inference hosts: 8 x H100",
            "peak_flops": "H100 SXM datasheet: 989 TFLOP/s dense bf16",
            "matmul_eff": "assumption: about 600 TFLOP/s achieved bf16 GEMM",
            "attn_fwd_eff": "Meta's context-parallel inference paper: FA3 about 540 TFLOP/s at 8K on H100",
            "attn_bwd_eff": "FA3 paper: backward 1.5-1.75x FA2's (FA2 reaches about 35% of H100 peak)",
            "causal_eff": "as A100 (FA2 paper)", "mem_bw": "H100 SXM: 3.35 TB/s", "mem_bytes": "80 GB",
            "intra_bw": "NVLink4 900 GB/s total = 450 GB/s per direction (burstattn cluster's figure)",
            "inter_bw": "400 Gb/s InfiniBand/RoCE per GPU (Meta's CP inference) = 50 GB/s",
            "intra_lat": "burstattn cluster's figure", "inter_lat": "burstattn cluster's figure",
            "emulated_attn_flops": "burstattn cluster's attention rate for this preset (since 04c5633)"}),
    ClusterHW(
        "h200-nvlink-ib", 8, 989e12, 0.60, 0.55, 0.45, 0.88, 4.8e12, 141e9,
        intra_bw=450e9, intra_lat=2e-6, inter_bw=50e9, inter_lat=5e-6, host_bw=50e9, host_mem_bytes=2e12 / 8,
        fp32_flops=67e12, host_adam_bw=0.5 * 614.4e9 / 8,
        sources={"fp32_flops": f"H200 {_FP32}: 67 TFLOP/s (as H100 SXM)",
                 "host_adam_bw": _ADAM_H100 + " (assumed the same host as DGX H100)",
            "host_bw": _PCIE5, "host_mem_bytes": "assumption: 2 TB per 8-GPU node (as DGX H100; NVIDIA DGX H200: 2 TB)",
            "devices_per_node": "HGX H200: 8 GPUs", "peak_flops": "H200: same compute as H100 SXM, 989 TFLOP/s",
            "matmul_eff": "as h100-nvlink-ib (assumption)", "attn_fwd_eff": "as h100-nvlink-ib (FA3 / Meta)",
            "attn_bwd_eff": "as h100-nvlink-ib", "causal_eff": "as A100 (FA2 paper)",
            "mem_bw": "H200 datasheet: 4.8 TB/s", "mem_bytes": "141 GB",
            "intra_bw": "NVLink4 900 GB/s total", "inter_bw": "400 Gb/s per GPU (4 x 400 Gb/s IB per node is "
                                                              "half of that: override with --inter-gbps)",
            "intra_lat": "as h100-nvlink-ib", "inter_lat": "as h100-nvlink-ib"}),
    ClusterHW(
        "tpuv4", 4, 275e12, 0.60, 0.50, 0.45, 0.88, 1.2e12, 32 * 2**30,
        intra_bw=268e9, intra_lat=5e-6, inter_bw=268e9, inter_lat=5e-6, host_bw=16e9, host_mem_bytes=64e9,
        fp32_flops=275e12 / 6, host_adam_bw=25e9,
        sources={"fp32_flops": "assumption: float32 matmuls as 6 bf16 passes (XLA's 'highest' precision): 275 / 6",
                 "host_adam_bw": "assumption: burstattn's optimizer offload is FSDP2's, a PyTorch path (not modelled "
                                 "from a TPU host's figures)",
            "host_bw": "assumption: PCIe 3.0 x16 per chip (16 GB/s); burstattn's offload is a CUDA path",
            "host_mem_bytes": "assumption: 256 GB of host memory per 4-chip TPUv4 host",
            "devices_per_node": "4 chips per TPUv4 host; the ICI torus spans hosts, so both levels are ICI",
            "peak_flops": "TPU v4: 275 TFLOP/s bf16", "matmul_eff": "assumption: 60% (no published figure used)",
            "attn_fwd_eff": "assumption: blockwise attention in JAX at half of peak",
            "attn_bwd_eff": "assumption", "causal_eff": "as A100 (FA2 paper)",
            "mem_bw": "TPU v4: 1,200 GB/s", "mem_bytes": "32 GiB HBM",
            "intra_bw": "RingAttention paper: 268 GB/s ICI per chip", "inter_bw": "the same ICI (3-D torus)",
            "intra_lat": "assumption", "inter_lat": "assumption"}),
)
PRESETS: Mapping[str, ClusterHW] = MappingProxyType({c.name: c for c in _PRESETS})


def preset(name: str) -> ClusterHW:
    """The named cluster preset (``ValueError`` naming the known ones otherwise)."""
    if name not in PRESETS:
        raise ValueError(f"unknown cluster preset {name!r}; presets: {sorted(PRESETS)}")
    return PRESETS[name]


def emulation_figures(name: str) -> dict:
    """``burstattn cluster``'s view of a preset: attention FLOP/s and links per GPU (one way,
    bytes/s, seconds): ``{"flops", "intra", "inter", "intra_lat", "inter_lat"}``."""
    hw = preset(name)
    if hw.emulated_attn_flops is None:
        raise ValueError(f"preset {name!r} has no emulated-cluster figures; those that do: "
                         f"{sorted(n for n, c in PRESETS.items() if c.emulated_attn_flops)}")
    return dict(flops=hw.emulated_attn_flops, intra=hw.intra_bw, inter=hw.inter_bw, intra_lat=hw.intra_lat,
                inter_lat=hw.inter_lat)


def load(path_or_name: str) -> ClusterHW:
    """A preset name, or a JSON file written by ``burstattn sim calibrate`` / :func:`save` (its
    ``"hw"`` object). Raises ``ValueError`` for an unknown name or a malformed file."""
    if path_or_name in PRESETS:
        return PRESETS[path_or_name]
    path = Path(path_or_name)
    if not path.suffix == ".json" or not path.exists():
        raise ValueError(f"unknown cluster preset {path_or_name!r}; presets: {sorted(PRESETS)} (or a .json spec "
                         "file from `burstattn sim calibrate`)")
    data = json.loads(path.read_text())
    hw = data.get("hw", data)
    if "cluster" in data:  # written by `sim calibrate`: this machine's CPU, its memory the host's
        hw = {"host_is_device": True, **hw}
    if hw.get("plain_attn_rates") is not None:
        hw = {**hw, "plain_attn_rates": tuple(hw["plain_attn_rates"])}
    try:
        return ClusterHW(**hw)
    except TypeError as e:
        raise ValueError(f"{path}: not a cluster spec ({e})") from None


def save(hw: ClusterHW, path: str, extra: Optional[dict] = None) -> None:
    """Write ``{"hw": ..., **extra}`` as JSON (readable by :func:`load`)."""
    Path(path).write_text(json.dumps({"hw": hw.to_dict(), **(extra or {})}, indent=1) + "\n")

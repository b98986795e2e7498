"""Timing of repeated calls inside a rank, and a description of the machine for benchmark records."""
from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch

__all__ = ["Timing", "time_repeats", "time_interleaved", "machine_info", "default_threads_per_rank",
           "CpuSnapshot", "cpu_snapshot", "other_load", "code_version"]


@dataclass(frozen=True)
class Timing:
    """Wall-clock seconds of ``repeats`` calls after ``warmup`` discarded ones."""

    samples: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def spread(self) -> float:
        """(max - min) / median: how noisy the repeats were."""
        return (max(self.samples) - min(self.samples)) / self.median if self.median > 0 else 0.0


def time_repeats(fn: Callable[[], object], *, repeats: int, warmup: int,
                 barrier: Optional[Callable[[], None]] = None,
                 sync: Optional[Callable[[], None]] = None) -> Timing:
    """Call ``fn`` ``warmup`` times, then time ``repeats`` calls one by one.

    ``barrier`` (e.g. ``dist.barrier``) runs before each call so that all ranks start together;
    ``sync`` (e.g. ``torch.cuda.synchronize``) runs before the clock is read on both ends.
    Raises ValueError if ``repeats < 1``.
    """
    return time_interleaved({"fn": fn}, repeats=repeats, warmup=warmup, barrier=barrier, sync=sync)["fn"]


def time_interleaved(fns: dict[str, Callable[[], object]], *, repeats: int, warmup: int,
                     barrier: Optional[Callable[[], None]] = None,
                     sync: Optional[Callable[[], None]] = None) -> dict[str, Timing]:
    """Like :func:`time_repeats` for several functions, alternating them call by call (A B A B ...).

    Alternating puts every candidate under the same machine conditions (other load, clock
    changes), which matters when two variants differ by a few percent.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(warmup + repeats):
        for name, fn in fns.items():
            if barrier is not None:
                barrier()
            if sync is not None:
                sync()
            t0 = time.perf_counter()
            fn()
            if sync is not None:
                sync()
            if i >= warmup:
                samples[name].append(time.perf_counter() - t0)
    return {name: Timing(tuple(s)) for name, s in samples.items()}


def default_threads_per_rank(world_size: int) -> int:
    """``max(1, cores // world_size)``: never more threads than cores in total (when it can be kept)."""
    return max(1, (os.cpu_count() or 1) // world_size)


@dataclass(frozen=True)
class MachineInfo:
    """Where a benchmark ran."""

    cpu: str
    cores: int
    memory_gib: float
    os: str
    python: str
    torch: str
    cuda: Optional[str]
    gpus: tuple[str, ...]
    load_avg_1m: Optional[float]


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return float("nan")


def machine_info() -> dict:
    """A JSON-ready description of this machine and software (cpu, cores, memory, torch, gpus, load)."""
    gpus = tuple(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())) \
        if torch.cuda.is_available() else ()
    try:
        load = round(os.getloadavg()[0], 2)
    except OSError:
        load = None
    info = MachineInfo(cpu=_cpu_name(), cores=os.cpu_count() or 1, memory_gib=round(_memory_gib(), 1),
                       os=platform.platform(), python=sys.version.split()[0], torch=torch.__version__,
                       cuda=torch.version.cuda, gpus=gpus, load_avg_1m=load)
    return asdict(info)


@dataclass(frozen=True)
class CpuSnapshot:
    """Machine-wide busy and steal CPU seconds (``/proc/stat``) and this process tree's CPU seconds."""

    wall: float
    busy_s: float
    steal_s: float
    own_s: float


def cpu_snapshot() -> Optional[CpuSnapshot]:
    """Now, or ``None`` where ``/proc/stat`` is missing (not Linux)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    t = os.times()  # children: ranks that have been joined (run_local joins them before returning)
    return CpuSnapshot(time.perf_counter(), (user + nice + system + irq + softirq) / tick, steal / tick,
                       t.user + t.system + t.children_user + t.children_system)


def other_load(before: Optional[CpuSnapshot], after: Optional[CpuSnapshot]) -> Optional[dict]:
    """CPU used by everything else on the machine between two snapshots, in cores on average.

    ``other_cores``: busy time of processes outside this process tree / wall time (0 on a quiet
    machine); ``steal_cores``: time the hypervisor gave to other guests / wall time.
    """
    if before is None or after is None:
        return None
    wall = after.wall - before.wall
    other = (after.busy_s - before.busy_s) - (after.own_s - before.own_s)
    return {"wall_s": round(wall, 1), "other_cores": round(max(other, 0.0) / wall, 2),
            "steal_cores": round((after.steal_s - before.steal_s) / wall, 2)}


def code_version() -> Optional[dict]:
    """``{"commit": short hash, "dirty": bool}`` of the git checkout holding this package, or ``None``
    (installed from a wheel, or no git)."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        commit = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10, check=True).stdout.strip()
        status = subprocess.run(["git", "-C", root, "status", "--porcelain", "--", "burstattn"],
                                capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": bool(status.strip())}

"""Measured peak memory of one call, per process (shared by ``burstattn demo`` and ``burstattn bench``).

CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, relative to what was
allocated before the call.

CPU: PyTorch has no allocator high-water mark on CPU, so we record the call under
``torch.profiler.profile(activities=[CPU], profile_memory=True)`` and replay the allocator's
``[memory]`` events (signed byte deltas: + on allocation, - on free) in time order. The peak is the
largest prefix sum, i.e. the most bytes the call held *on top of* what was allocated before it
(inputs that already existed are not counted; freeing them counts as negative). Only allocations made
through PyTorch's allocator are seen; memory that a backend library (gloo, MKL, OpenMP) allocates
itself is not.

Checked by :func:`self_check` on a known pattern (allocate 100 MB, free it, allocate 50 MB ->
peak 100 MB, end 50 MB).
"""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import torch

T = TypeVar("T")

__all__ = ["MemoryPeak", "measure_peak", "peak_from_deltas", "self_check"]


@dataclass(frozen=True)
class MemoryPeak:
    """Peak memory of one call on one process.

    Attributes:
        peak_bytes: the most bytes held on top of the allocation before the call (>= 0).
        end_bytes: bytes still held on top of it when the call returned (what it kept: outputs, saved tensors).
        device: "cpu" or "cuda:N".
        method: how it was measured ("cuda_max_memory_allocated" or "profiler_memory_events").
    """

    peak_bytes: int
    end_bytes: int
    device: str
    method: str


def peak_from_deltas(deltas: list[tuple[int, int]]) -> tuple[int, int]:
    """Largest prefix sum (floored at 0) and final sum of ``(time_ns, delta_bytes)`` pairs, in time order."""
    running, peak = 0, 0
    for _, delta in sorted(deltas, key=lambda td: td[0]):
        running += delta
        peak = max(peak, running)
    return peak, running


@contextlib.contextmanager
def native_stderr_filtered(prefix: str):
    """Hold back this process's native stderr (file descriptor 2, where C++ libraries write) inside
    the block, then write it back without the lines starting with ``prefix``."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = [line for line in held.read().decode(errors="replace").splitlines(keepends=True)
                    if not line.startswith(prefix)]
            if kept:
                sys.stderr.write("".join(kept))


def _measure_cpu(fn: Callable[..., T], args: tuple, kwargs: dict) -> tuple[T, MemoryPeak]:
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False)
    with native_stderr_filtered("USDT:"):  # kineto's profiler_start line (C++, fd 2; every rank, every call)
        prof.start()
    try:
        result = fn(*args, **kwargs)  # its own stderr passes as it comes
    finally:
        with native_stderr_filtered("USDT:"):  # ... and its profiler_stop line
            prof.stop()
    deltas = []
    for ev in prof.profiler.kineto_results.events():  # raw events: includes allocations nested inside ops
        if ev.name() == "[memory]" and ev.device_type() == torch.autograd.DeviceType.CPU:
            deltas.append((ev.start_ns(), int(ev.nbytes())))
    peak, end = peak_from_deltas(deltas)
    return result, MemoryPeak(peak, end, "cpu", "profiler_memory_events")


def _measure_cuda(fn: Callable[..., T], args: tuple, kwargs: dict, device: torch.device) -> tuple[T, MemoryPeak]:
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    result = fn(*args, **kwargs)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    end = torch.cuda.memory_allocated(device) - before
    return result, MemoryPeak(max(peak, 0), end, str(device), "cuda_max_memory_allocated")


def measure_peak(fn: Callable[..., T], *args: Any, device: torch.device | str = "cpu",
                 **kwargs: Any) -> tuple[T, MemoryPeak]:
    """Run ``fn(*args, **kwargs)`` once and return ``(result, MemoryPeak)`` for ``device``.

    Raises:
        ValueError: for a device type other than cpu or cuda.
    """
    device = torch.device(device)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return _measure_cuda(fn, args, kwargs, device)
    if device.type == "cpu":
        return _measure_cpu(fn, args, kwargs)
    raise ValueError(f"measure_peak: device must be cpu or cuda, got {device}")


def self_check(device: torch.device | str = "cpu") -> MemoryPeak:
    """Measure a known pattern: 100 MB allocated and freed, then 50 MB kept. Raises AssertionError if off."""

    def pattern() -> torch.Tensor:
        a = torch.ones(25_000_000, dtype=torch.float32, device=device)  # 100 MB
        del a
        return torch.ones(12_500_000, dtype=torch.float32, device=device)  # 50 MB, kept

    _, mem = measure_peak(pattern, device=device)
    assert abs(mem.peak_bytes - 100_000_000) <= 1_000_000, mem
    assert abs(mem.end_bytes - 50_000_000) <= 1_000_000, mem
    return mem

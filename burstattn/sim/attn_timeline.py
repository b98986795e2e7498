"""What the attention timelines are made of: the call's shape, one pass's time split and events, and
the kernel cost of a plan's work (pure)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from . import plans
from .hardware import ClusterHW


@dataclass(frozen=True)
class AttnShape:
    """One attention call: ``batch`` x ``seq_len`` global tokens, heads of this tp rank."""

    batch: int
    seq_len: int
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16
    causal: bool = True


@dataclass
class Pass:
    """One pass (forward or backward) of the slowest rank, and the events for a Gantt chart."""

    time: float = 0.0
    compute: float = 0.0
    idle: float = 0.0
    exposed_comm: float = 0.0
    bytes_sent: float = 0.0
    events: list = field(default_factory=list)  # (rank, kind, start, stop), kind compute|comm

    def add(self, other: "Pass", offset: bool = True) -> "Pass":
        shift = self.time if offset else 0.0
        self.events += [(r, k, a + shift, b + shift) for r, k, a, b in other.events]
        self.time += other.time
        self.compute += other.compute
        self.idle += other.idle
        self.exposed_comm += other.exposed_comm
        self.bytes_sent += other.bytes_sent
        return self


@dataclass(frozen=True)
class AttnTimeline:
    forward: Pass
    backward: Pass
    backward_mode: str


def kernel_seconds(hw: ClusterHW, shape: AttnShape, work: plans.StepWork, backward: bool) -> np.ndarray:
    """Seconds of kernel work per (rank, step) of ``work``."""
    per_entry = (10 if backward else 4) * shape.head_dim * shape.q_heads * shape.batch
    eff = work.full + work.diag / hw.causal_eff
    return eff * per_entry / hw.attn_rate(backward) + work.calls * hw.kernel_overhead_s


def element_sizes(shape: AttnShape) -> tuple[int, int]:
    """``(e, a)``: bytes of an input and of an accumulator element."""
    e = plans.element_size(shape.dtype)
    return e, plans.element_size(plans.accum_dtype(shape.dtype))

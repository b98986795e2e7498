"""The autograd function of burst attention: validates nothing, saves what the backward needs,
and calls the engine (:mod:`burstattn.engine.run`). Inputs and outputs use flash-attn's
``[B, n, H, D]``; the engine copies head groups to ``[B, h, n, D]`` as it goes."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from .comm.ring import RingComm
from .comm.stats import CommStats, active_stats
from .config import AttnConfig
from .engine.passes import BlockCalls
from .engine.run import attention_backward, attention_forward, build_plan, head_groups
from .kernels import get_kernel
from .layout import local_positions
from .masks.blocks import op_mask
from .masks.setup import effective_mask
from .trace import StepTrace, active_trace


@dataclass(frozen=True)
class RingContext:
    """Where a call runs: the group (``None`` for a world of one), this rank and the world size."""

    group: Optional[dist.ProcessGroup]
    rank: int
    world_size: int

    def comm(self, phase: str, stats: Optional[CommStats], trace: Optional[StepTrace],
             topology=None):
        """A fresh ring communicator for one pass (``None`` for a world of one); with a
        ``topology`` (schedule "double") the inner and outer ring communicators."""
        if self.world_size == 1:
            return None
        if topology is not None:
            from .engine.double import TwoLevelComm
            return TwoLevelComm(RingComm(topology.inner_group, phase, stats, trace) if topology.ranks_per_node > 1 else None,
                                RingComm(topology.outer_group, phase, stats, trace) if topology.nodes > 1 else None)
        return RingComm(self.group, phase, stats, trace)


def block_calls(cfg: AttnConfig, plan, local_len: int, scale: float) -> BlockCalls:
    """The kernel calls of a call; with a mask ``plan`` (:class:`~burstattn.masks.plan.MaskPlan`)
    PARTIAL ops get their bool block from the mask."""
    kernel = get_kernel(cfg.backend)
    if plan is None:
        return BlockCalls(kernel, scale)
    mask, seq_len, world = effective_mask(cfg), local_len * plan.world_size, plan.world_size
    pos = [local_positions(seq_len, r, world, cfg.layout) for r in range(world)]

    def mask_of(op, q_owner: int, k_owner: int):
        return op_mask(mask, cfg.causal, seq_len, pos[q_owner], pos[k_owner], op)
    fallback = kernel if kernel.supports_mask else get_kernel("sdpa")  # flash-attn: no explicit masks
    return BlockCalls(kernel, scale, mask_of, fallback)


def _engine(ring: RingContext, cfg: AttnConfig, n: int, travelling: str, mask_plan, scale: float):
    """The plan and the kernel calls of one pass."""
    p = ring.world_size
    positions = [local_positions(n * p, r, p, cfg.layout) for r in range(p)]
    per_node = cfg.topology.ranks_per_node if cfg.schedule == "double" and p > 1 else 1
    plan = build_plan(ring.rank, p, positions=positions, causal=cfg.causal, travelling=travelling,
                      schedule=cfg.schedule, ranks_per_node=per_node, mask_plan=mask_plan)
    return plan, block_calls(cfg, mask_plan, n, scale)


class BurstAttnFunction(torch.autograd.Function):
    """``out, lse = f(q, k, v)`` distributed over ``ring``; ``cfg`` must be resolved
    (concrete backend and backward mode)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: RingContext,
                cfg: AttnConfig, plan=None):
        b, n, hq, d = q.shape
        scale = cfg.scale_for(d)
        stats, trace = active_stats(), active_trace()
        comm = ring.comm("forward", stats, trace, cfg.topology)
        eplan, calls = _engine(ring, cfg, n, "kv", plan, scale)
        out, lse = attention_forward(comm, eplan, calls, q, k, v, head_groups(b, n, hq, k.shape[2], d))
        if any(ctx.needs_input_grad[:3]):
            # the inputs themselves (no copies): the backward makes its [B, H, n, D] copies per head group
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.ring, ctx.cfg, ctx.scale, ctx.stats, ctx.trace = ring, cfg, scale, stats, trace
            ctx.plan = plan
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout: torch.Tensor, _dlse):
        q, k, v, out, lse = ctx.saved_tensors  # [B, n, H, D]
        ring, cfg = ctx.ring, ctx.cfg
        stats = active_stats() or ctx.stats
        trace = active_trace() or ctx.trace
        b, n, hq, d = q.shape
        comm = ring.comm("backward", stats, trace, cfg.topology)
        travelling = "kv" if cfg.backward == "kv" else "q"
        eplan, calls = _engine(ring, cfg, n, travelling, ctx.plan, ctx.scale)
        dq, dk, dv = attention_backward(comm, eplan, calls, dout, q, k, v, out, lse,
                                        head_groups(b, n, hq, k.shape[2], d))
        return dq, dk, dv, None, None, None

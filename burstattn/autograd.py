"""The autograd function of burst attention: validates nothing, saves what the backward needs,
and calls the engine. Inputs and outputs use flash-attn's ``[B, n, H, D]``; the engine works
on ``[B, H, n, D]`` views of the same memory."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from .comm.ring import RingComm
from .comm.stats import CommStats, active_stats
from .config import AttnConfig
from .engine import direct, masked
from .engine import ring as engine
from .engine.schedule import distflash_plan, ring_plan
from .kernels import get_kernel
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


def _masked_call(cfg: AttnConfig, plan, local_len: int, scale: float) -> masked.MaskedCall:
    kernel = get_kernel(cfg.backend)
    fallback = kernel if kernel.supports_mask else get_kernel("sdpa")  # flash-attn: no explicit masks
    return masked.MaskedCall(effective_mask(cfg), cfg.causal, local_len * plan.world_size, cfg.layout, plan,
                             kernel, fallback, scale)


def _plans(ring: RingContext, cfg: AttnConfig, n: int, travelling: str):
    """The flat ring plan, or the two-level plan of schedule "double"."""
    if cfg.schedule == "double" and ring.world_size > 1:
        from .engine.double import double_plan
        return double_plan(ring.rank, ring.world_size, cfg.topology.ranks_per_node, cfg.layout, cfg.causal, n,
                           travelling)
    return ring_plan(ring.rank, ring.world_size, cfg.layout, cfg.causal, n, travelling)


class BurstAttnFunction(torch.autograd.Function):
    """``out, lse = f(q, k, v)`` distributed over ``ring``; ``cfg`` must be resolved
    (concrete backend and backward mode)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: RingContext,
                cfg: AttnConfig, plan=None):
        # [B, n, H, D] -> [B, H, n, D], contiguous: the fused CPU kernel runs 15-24% slower on
        # strided views (measured at 16K tokens), far more than this one O(n) copy costs
        qh, kh, vh = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        n = q.shape[1]
        scale = cfg.scale_for(q.shape[-1])
        stats, trace = active_stats(), active_trace()
        comm, kernel = ring.comm("forward", stats, trace, cfg.topology), get_kernel(cfg.backend)
        if plan is not None:
            out32, lse = masked.masked_forward(comm, _masked_call(cfg, plan, n, scale), qh, kh, vh)
        elif cfg.schedule == "distflash":
            out32, lse = direct.distflash_forward(comm, distflash_plan(ring.rank, ring.world_size), kernel,
                                                  qh, kh, vh, scale)
        else:
            out32, lse = engine.forward(comm, _plans(ring, cfg, n, "kv"), kernel, qh, kh, vh, scale)
        out = out32.transpose(1, 2).to(q.dtype).contiguous()  # [B, n, Hq, D]
        if any(ctx.needs_input_grad[:3]):
            # keep the contiguous [B, H, n, D] copies (not q, k, v): the backward kernels want them
            # too, and the caller's q, k, v can then be freed after the forward
            ctx.save_for_backward(qh, kh, vh, out, lse)
            ctx.ring, ctx.cfg, ctx.scale, ctx.stats, ctx.trace = ring, cfg, scale, stats, trace
            ctx.plan = plan
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout: torch.Tensor, _dlse):
        qh, kh, vh, out, lse = ctx.saved_tensors  # q, k, v as [B, H, n, D]; out as [B, n, Hq, D]
        ring, cfg = ctx.ring, ctx.cfg
        stats = active_stats() or ctx.stats
        trace = active_trace() or ctx.trace
        dout_h, out_h = (x.transpose(1, 2).contiguous() for x in (dout, out))
        comm = ring.comm("backward", stats, trace, cfg.topology)
        if ctx.plan is not None:
            run = masked.masked_backward_kv if cfg.backward == "kv" else masked.masked_backward_query
            dq, dk, dv = run(comm, _masked_call(cfg, ctx.plan, qh.shape[2], ctx.scale), dout_h.to(qh.dtype),
                             qh, kh, vh, out_h, lse)
            return (dq.transpose(1, 2).to(qh.dtype), dk.transpose(1, 2).to(kh.dtype),
                    dv.transpose(1, 2).to(vh.dtype), None, None, None)
        if cfg.schedule == "distflash":
            plans, run = distflash_plan(ring.rank, ring.world_size), direct.distflash_backward
        else:
            travelling = "kv" if cfg.backward == "kv" else "q"
            plans = _plans(ring, cfg, qh.shape[2], travelling)
            run = engine.backward_kv if cfg.backward == "kv" else engine.backward_query
        dq, dk, dv = run(comm, plans, get_kernel(cfg.backend), dout_h.to(qh.dtype), qh, kh, vh, out_h, lse,
                         ctx.scale)
        return (dq.transpose(1, 2).to(qh.dtype), dk.transpose(1, 2).to(kh.dtype),
                dv.transpose(1, 2).to(vh.dtype), None, None, None)

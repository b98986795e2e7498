"""The two engine calls of burst attention, :func:`forward_pass` and :func:`backward_pass`, and the
eager autograd function over them (:class:`BurstAttnFunction`).

Both passes validate nothing (the callers run the cross-rank input check first). The custom ops
of :mod:`burstattn.ops` call exactly these two functions, so which engine functions run is
decided here, in one place. Inputs and outputs use flash-attn's ``[B, n, H, D]``; the engine
works on ``[B, H, n, D]`` copies.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from .comm.ring import RingComm
from .comm.stats import CommStats, active_stats
from .config import AttnConfig
from .engine import direct, masked
from .engine import ring as engine
from .engine.double import TwoLevelComm, double_plan
from .engine.schedule import distflash_plan, ring_plan
from .kernels import get_kernel
from .masks.setup import GuardedMaskMod, effective_mask, raise_mask_failures
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
            return TwoLevelComm(RingComm(topology.inner_group, phase, stats, trace) if topology.ranks_per_node > 1 else None,
                                RingComm(topology.outer_group, phase, stats, trace) if topology.nodes > 1 else None)
        return RingComm(self.group, phase, stats, trace)


DOUBLE_BACKWARD = ("burstattn: second-order gradients (create_graph=True through the attention backward, "
                   "double backward) are not supported")


def without_autocast(fn):
    """Run ``fn`` with autocast off on the device of its first tensor argument: attention computes in
    its inputs' dtype under ``torch.autocast`` too (one behaviour for every strategy; cast q, k, v
    yourself for another precision)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
        with torch.autocast(device, enabled=False):
            return fn(*args, **kwargs)

    return run


def refuse_double_backward() -> None:
    """Raise in an attention backward that runs with ``create_graph=True`` (grad mode on): its result
    would not be differentiable, and a silently wrong second derivative is worse than an error."""
    if torch.is_grad_enabled():
        raise RuntimeError(DOUBLE_BACKWARD)


def masked_call(cfg: AttnConfig, plan, local_len: int, scale: float, mask=None) -> masked.MaskedCall:
    """The masked engine's :class:`~burstattn.engine.masked.MaskedCall` for this call (``mask``:
    the mask to evaluate, default the call's own)."""
    kernel = get_kernel(cfg.backend)
    fallback = kernel if kernel.supports_mask else get_kernel("sdpa")  # flash-attn: no explicit masks
    mask = effective_mask(cfg) if mask is None else mask
    return masked.MaskedCall(mask, cfg.causal, local_len * plan.world_size, cfg.layout, plan, kernel, fallback, scale)


def ring_plans(ring: RingContext, cfg: AttnConfig, n: int, travelling: str):
    """The flat ring plan, or the two-level plan of schedule "double"."""
    if cfg.schedule == "double" and ring.world_size > 1:
        return double_plan(ring.rank, ring.world_size, cfg.topology.ranks_per_node, cfg.layout, cfg.causal, n,
                           travelling)
    return ring_plan(ring.rank, ring.world_size, cfg.layout, cfg.causal, n, travelling)


def guarded(cfg: AttnConfig):
    """The call's mask with its ``mask_mod`` guarded (see :class:`~burstattn.masks.setup.GuardedMaskMod`),
    and the guard (``None`` without a ``mask_mod``)."""
    mask = effective_mask(cfg)
    if mask.mask_mod is None:
        return None, None
    guard = GuardedMaskMod(mask.mask_mod)
    from dataclasses import replace
    return replace(mask, mask_mod=guard), guard


@without_autocast
def forward_pass(ring: RingContext, cfg: AttnConfig, plan, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The distributed forward on this rank's shard.

    Args:
        q: ``[B, n, Hq, D]``; k, v: ``[B, n, Hkv, D]``; ``cfg`` resolved (concrete backend and
            backward mode); ``plan``: the mask plan of a sparse call, else ``None``.
    Returns:
        ``out [B, n, Hq, D]`` (q's dtype) and ``lse [B, Hq, n]`` (float32; float64 for float64).
        The backward needs the inputs, ``out`` and ``lse`` (nothing else is kept).
    """
    # [B, n, H, D] -> [B, H, n, D], contiguous: the fused CPU kernel runs 15-24% slower on
    # strided views (measured at 16K tokens), far more than this one O(n) copy costs
    qh, kh, vh = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    n = q.shape[1]
    scale = cfg.scale_for(q.shape[-1])
    comm, kernel = ring.comm("forward", active_stats(), active_trace(), cfg.topology), get_kernel(cfg.backend)
    if plan is not None:
        mask, guard = guarded(cfg)
        out32, lse = masked.masked_forward(comm, masked_call(cfg, plan, n, scale, mask), qh, kh, vh)
        raise_mask_failures(guard, ring)
    elif cfg.schedule == "distflash":
        out32, lse = direct.distflash_forward(comm, distflash_plan(ring.rank, ring.world_size), kernel,
                                              qh, kh, vh, scale)
    else:
        out32, lse = engine.forward(comm, ring_plans(ring, cfg, n, "kv"), kernel, qh, kh, vh, scale)
    return out32.transpose(1, 2).to(q.dtype).contiguous(), lse  # out [B, n, Hq, D]


@without_autocast
def backward_pass(ring: RingContext, cfg: AttnConfig, plan, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, stats: Optional[CommStats] = None,
                  trace: Optional[StepTrace] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The distributed backward: ``dout, out [B, n, Hq, D]``, ``q [B, n, Hq, D]``, ``k, v [B, n, Hkv, D]``,
    ``lse [B, Hq, n]`` -> ``dq [B, n, Hq, D]``, ``dk, dv [B, n, Hkv, D]`` in the inputs' dtype.
    Bytes and steps go to the active meter and trace (else ``stats`` / ``trace``)."""
    qh, kh, vh = (x.transpose(1, 2).contiguous() for x in (q, k, v))  # [B, H, n, D]
    stats, trace = active_stats() or stats, active_trace() or trace
    dout_h, out_h = (x.transpose(1, 2).contiguous() for x in (dout.to(q.dtype), out))
    comm = ring.comm("backward", stats, trace, cfg.topology)
    scale = cfg.scale_for(q.shape[-1])
    if plan is not None:
        mask, guard = guarded(cfg)
        run = masked.masked_backward_kv if cfg.backward == "kv" else masked.masked_backward_query
        dq, dk, dv = run(comm, masked_call(cfg, plan, q.shape[1], scale, mask), dout_h, qh, kh, vh, out_h, lse)
        raise_mask_failures(guard, ring)
    else:
        if cfg.schedule == "distflash":
            plans, run = distflash_plan(ring.rank, ring.world_size), direct.distflash_backward
        else:
            plans = ring_plans(ring, cfg, q.shape[1], "kv" if cfg.backward == "kv" else "q")
            run = engine.backward_kv if cfg.backward == "kv" else engine.backward_query
        dq, dk, dv = run(comm, plans, get_kernel(cfg.backend), dout_h, qh, kh, vh, out_h, lse, scale)
    return (dq.transpose(1, 2).to(q.dtype), dk.transpose(1, 2).to(k.dtype), dv.transpose(1, 2).to(v.dtype))


class BurstAttnFunction(torch.autograd.Function):
    """``out, lse = f(q, k, v)`` distributed over ``ring`` (eager; ``cfg`` resolved). Used where the
    custom op cannot carry the call (a ``mask_mod``, a Python function) and for local masked attention.
    Second-order gradients are refused (:func:`refuse_double_backward`)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: RingContext,
                cfg: AttnConfig, plan=None):
        out, lse = forward_pass(ring, cfg, plan, q, k, v)
        if any(ctx.needs_input_grad[:3]):
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.ring, ctx.cfg, ctx.plan = ring, cfg, plan
            ctx.stats, ctx.trace = active_stats(), active_trace()
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout: torch.Tensor, _dlse):
        refuse_double_backward()
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = backward_pass(ctx.ring, ctx.cfg, ctx.plan, dout, q, k, v, out, lse, ctx.stats, ctx.trace)
        return dq, dk, dv, None, None, None

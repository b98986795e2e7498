"""A world-P plan emulated in one process: every rank's block pairs run here, with the same plans,
kernel calls (the step policy included) and float32 merges as the ring, but no process group.

Rank ``r``'s plan is the ``"gathered"`` schedule over every rank's K/V (:func:`~burstattn.engine.run.gathered_forward`):
the pairs ``(r, s)`` a ring or the sparse schedule computes for that rank, one kernel call per pair (and
head group) where the policy says so. What is not emulated: the transfers and their overlap. Used by the
tests (the GPU path's kernels on CPU, a GPU modelled through ``device_type="cuda"``) and the GPU session
script (the ring's exactness and one rank's kernel time on one device).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from .call import Call
from ..engine.run import build_plan, gathered_backward, gathered_forward
from ..engine.bytes import accum_dtype
from ..kernels import resolve_backend
from ..layouts.named import local_positions
from ..masks.blocks import mask_blocks
from .engine_adapter import block_calls, call_positions, kernel_needs


@dataclass(frozen=True)
class Emulated:
    """One emulated world: ``call`` (resolved), ``world``, and per rank its plan and kernel calls."""

    call: Call
    world: int
    plans: tuple
    calls: tuple

    def shard(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s shard of a full-sequence ``[B, N, ...]`` tensor."""
        return x.index_select(1, local_positions(x.shape[1], rank, self.world, self.call.layout).to(x.device))


def emulate(q: torch.Tensor, v: torch.Tensor, world: int, *, causal: bool = False, layout: str = "zigzag",
            mask=None, backend: str = "auto", grad_partials: str = "auto", device_type: Optional[str] = None,
            softmax_scale: Optional[float] = None) -> Emulated:
    """The plans and kernel calls of a world of ``world`` ranks for full-sequence ``q [B, N, Hq, D]`` (and
    ``v``, for its head size): ``mask`` an :class:`~burstattn.AttnMask` (or ``None``); ``device_type``: the
    device the step policy is chosen for (``None``: q's)."""
    cfg = Call(causal=causal, softmax_scale=softmax_scale, layout=layout, mask=mask, grad_partials=grad_partials,
               device_type=device_type, backend=backend)
    cfg = replace(cfg, backend=resolve_backend(backend, q.device, q.dtype, kernel_needs(cfg, q.shape[-1], v.shape[-1])))
    n_total = q.shape[1]
    n = n_total // world
    pos = [local_positions(n_total, r, world, layout) for r in range(world)]
    blocks = None if mask is None else mask_blocks(mask, n_total)
    plans = tuple(build_plan(r, world, positions=pos, causal=causal, travelling="kv", schedule="gathered",
                             blocks=blocks) for r in range(world))
    q_one, v_one = q[:, :n], v[:, :n]
    calls = block_calls(cfg, mask is not None, call_positions(cfg, world, n, n), cfg.scale_for(q.shape[-1]),
                        q_one, v_one)
    return Emulated(cfg, world, plans, (calls,) * world)


def kv_blocks(em: Emulated, k: torch.Tensor, v: torch.Tensor) -> dict:
    """Every rank's K/V as the gathered plans read them: owner -> ``[2, B, Hkv, n, D]``."""
    return {s: torch.stack([em.shard(k, s).transpose(1, 2), em.shard(v, s).transpose(1, 2)])
            for s in range(em.world)}


def rank_forward(em: Emulated, rank: int, q: torch.Tensor, blocks: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s ``out [B, n, Hq, D]`` (q's dtype) and ``lse [B, Hq, n]`` from its block pairs."""
    return gathered_forward(em.plans[rank], em.calls[rank], em.shard(q, rank), blocks)


def emulated_forward(em: Emulated, q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole world's ``out [B, N, Hq, D]`` and ``lse [B, Hq, N]``, in global order."""
    blocks = kv_blocks(em, k, v)
    b, n_total, hq, _ = q.shape
    out = torch.empty(b, n_total, hq, v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(b, hq, n_total, dtype=accum_dtype(q.dtype), device=q.device)
    for r in range(em.world):
        idx = local_positions(n_total, r, em.world, em.call.layout).to(q.device)
        o, l = rank_forward(em, r, q, blocks)
        out.index_copy_(1, idx, o)
        lse.index_copy_(2, idx, l)
    return out, lse


def emulated_backward(em: Emulated, dout, q, k, v, out, lse) -> tuple[torch.Tensor, ...]:
    """``dq, dk, dv`` (global order, the inputs' dtypes) of :func:`emulated_forward`: every rank's dQ and
    its dK/dV partials summed per owner (in float32, as the reduce-scatter / ring would)."""
    blocks = kv_blocks(em, k, v)
    n_total = q.shape[1]
    acc = accum_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc, device=q.device)
    for r in range(em.world):
        idx = local_positions(n_total, r, em.world, em.call.layout).to(q.device)
        lse_r = lse.index_select(2, idx)
        dq_r, per_owner = gathered_backward(em.plans[r], em.calls[r], em.shard(dout, r), em.shard(q, r), blocks,
                                            em.shard(out, r), lse_r)
        dq.index_copy_(1, idx, dq_r.to(acc))
        for s, (dk_s, dv_s) in per_owner.items():
            ids = local_positions(n_total, s, em.world, em.call.layout).to(q.device)
            dk.index_add_(1, ids, dk_s.transpose(1, 2).to(acc))
            dv.index_add_(1, ids, dv_s.transpose(1, 2).to(acc))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

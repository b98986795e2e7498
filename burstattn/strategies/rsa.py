"""``strategy="rsa"``: Ring Self-Attention (Li et al., 2021, "Sequence Parallelism"), the
baseline the BurstAttention paper calls RingAttention.

Forward, two rings (:func:`burstattn.engine.ring.ring_loop`):

1. K circulates (op ``k``); each step fills the columns of the visiting rank's keys in this
   rank's full score matrix ``S [B, Hq, n, N]`` (float32; float64 for float64 inputs), with
   the causal mask taken from the global positions of both shards
   (:func:`burstattn.layout.local_positions`), so every layout is exact. Blocks the mask hides
   entirely are not computed (their columns stay ``-inf``).
2. A row softmax in place turns ``S`` into the probabilities ``P``.
3. V circulates (op ``v``); each step adds ``P[:, :, :, block] @ V_block`` to the output.

``P`` is kept for the backward: O(n x N) memory per rank, quadratic in the sequence length,
which is the cost the later algorithms remove and the reason this baseline exists.

Backward: K and V circulate once more (op ``kv``) with the dK/dV accumulator following one
step behind and ending with a hop home (op ``dkv``, float32), exactly like RingAttention's
backward, but every block's gradients come from the stored ``P`` (no recomputation):
``dS = P * (dO V^T - rowsum(dO * O))``, ``dQ += scale dS K``, ``dK += scale dS^T Q``,
``dV += P^T dO``.

Bytes per rank: forward ``(P-1) * 2*B*n*Hkv*d*e`` (k and v rings), backward
``(P-1) * 2*B*n*Hkv*d*e + P * 2*B*n*Hkv*d*a``. The scores are plain matmuls, not a fused
kernel (materialising them is the point), so ``backend`` can only be ``"auto"`` or
``"reference"`` (plain PyTorch).
"""
from __future__ import annotations

import torch

from ..autograd import RingContext, refuse_double_backward, without_autocast
from ..comm.stats import active_stats
from ..config import AttnConfig
from ..engine.ring import ring_loop
from ..engine.schedule import ring_plan
from ..formulas import accum_dtype, byte_totals, element_size, meta_bytes
from ..kernels.base import row_dot
from ..layout import local_positions
from ..comm.trace import active_trace
from .base import start


def _grouped(x: torch.Tensor, kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """``[B, n, Hq, D] -> [B, Hkv, g, n, D]`` (query heads grouped by the kv head they read)."""
    b, n, hq, d = x.shape
    # (B, n, Hq, D) -> (B, Hq, n, D) -> (B, Hkv, g, n, D)
    return x.transpose(1, 2).reshape(b, kv_heads, hq // kv_heads, n, d).to(dtype)


def _ungrouped(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[B, Hkv, g, n, D] -> [B, n, Hq, D]``."""
    b, hkv, g, n, d = x.shape
    # (B, Hkv, g, n, D) -> (B, Hq, n, D) -> (B, n, Hq, D)
    return x.reshape(b, hkv * g, n, d).transpose(1, 2).to(dtype).contiguous()


class _RingSelfAttn(torch.autograd.Function):
    """``out = f(q, k, v)`` over ``ring``; keeps the probabilities for the backward."""

    @staticmethod
    @without_autocast
    def forward(ctx, q, k, v, ring: RingContext, cfg: AttnConfig):
        b, n, hq, d = q.shape
        hkv, p, acc = k.shape[2], ring.world_size, accum_dtype(q.dtype)
        scale, stats, trace = cfg.scale_for(d), active_stats(), active_trace()
        qg = _grouped(q, hkv, acc)  # (B, Hkv, g, n, D)
        plans = ring_plan(ring.rank, p, cfg.layout, cfg.causal, n, "kv")
        seq = n * p
        mine = local_positions(seq, ring.rank, p, cfg.layout).to(q.device)
        scores = torch.full((b, hkv, hq // hkv, n, seq), float("-inf"), dtype=acc, device=q.device)

        def fill(plan, kb):  # kb (B, Hkv, n, D): keys of rank plan.k_rank -> columns [k_rank*n, ...)
            if not plan.ops:
                return
            s = torch.matmul(qg, kb.to(acc).unsqueeze(2).transpose(-1, -2)).mul_(scale)  # (B, Hkv, g, n, n)
            if cfg.causal:
                theirs = local_positions(seq, plan.k_rank, p, cfg.layout).to(q.device)
                s.masked_fill_(theirs[None, :] > mine[:, None], float("-inf"))
            scores[..., plan.k_rank * n:(plan.k_rank + 1) * n] = s

        comm = ring.comm("forward", stats, trace)
        # the ring overwrites its carry buffer: always a copy, (B, n, Hkv, D) -> (B, Hkv, n, D)
        ring_loop(comm, plans, k.transpose(1, 2).clone(memory_format=torch.contiguous_format), "k", fill)
        # every row sees at least its own key, so the log-sum-exp is finite
        probs = scores.sub_(torch.logsumexp(scores, dim=-1, keepdim=True)).exp_()
        out = torch.zeros(qg.shape, dtype=acc, device=q.device)  # (B, Hkv, g, n, D)

        def apply(plan, vb):  # vb (B, Hkv, n, D)
            if plan.ops:
                out.add_(torch.matmul(probs[..., plan.k_rank * n:(plan.k_rank + 1) * n], vb.to(acc).unsqueeze(2)))

        ring_loop(comm, plans, v.transpose(1, 2).clone(memory_format=torch.contiguous_format), "v", apply)
        if any(ctx.needs_input_grad[:3]):
            ctx.save_for_backward(q, k, v, probs, out)
            ctx.ring, ctx.cfg, ctx.plans, ctx.stats, ctx.trace = ring, cfg, plans, stats, trace
        return _ungrouped(out, q.dtype)

    @staticmethod
    @without_autocast
    def backward(ctx, dout):
        refuse_double_backward()
        q, k, v, probs, out = ctx.saved_tensors
        n, hkv = q.shape[1], k.shape[2]
        acc, scale = out.dtype, ctx.cfg.scale_for(q.shape[3])
        qg, dog = _grouped(q, hkv, acc), _grouped(dout, hkv, acc)  # (B, Hkv, g, n, D)
        delta = row_dot(dog, out, acc).unsqueeze(-1)  # D = rowsum(dO * O), (B, Hkv, g, n, 1)
        dq = torch.zeros_like(qg)

        def compute(plan, kv):  # kv (2, B, Hkv, n, D) of rank plan.k_rank
            if not plan.ops:
                return None
            p_blk = probs[..., plan.k_rank * n:(plan.k_rank + 1) * n]  # (B, Hkv, g, n, n)
            kb, vb = kv[0].to(acc).unsqueeze(2), kv[1].to(acc).unsqueeze(2)  # (B, Hkv, 1, n, D)
            ds = p_blk * (torch.matmul(dog, vb.transpose(-1, -2)) - delta)
            dq.add_(torch.matmul(ds, kb), alpha=scale)
            # (B, Hkv, g, n, D) -> (B, Hkv, n, D): sum over the query heads sharing a kv head
            return (torch.matmul(ds.transpose(-1, -2), qg).sum(2).mul_(scale),
                    torch.matmul(p_blk.transpose(-1, -2), dog).sum(2))

        def fold(acc_buf, parts):
            if parts is not None:
                acc_buf[0] += parts[0]
                acc_buf[1] += parts[1]

        ring = ctx.ring
        comm = ring.comm("backward", active_stats() or ctx.stats, active_trace() or ctx.trace)
        kv = torch.stack([k.transpose(1, 2), v.transpose(1, 2)])  # (2, B, Hkv, n, D)
        acc0 = torch.zeros(kv.shape, dtype=acc, device=q.device)
        dkv = ring_loop(comm, ctx.plans, kv, "kv", compute, "dkv", acc0, fold)
        return (_ungrouped(dq, q.dtype), dkv[0].transpose(1, 2).to(k.dtype),
                dkv[1].transpose(1, 2).to(v.dtype), None, None)


def run(q, k, v, *, group, causal, softmax_scale, layout, backend="auto") -> torch.Tensor:
    """``q [B, n, Hq, D]``, ``k, v [B, n, Hkv, D]`` (this rank's shard in ``layout``) ->
    ``[B, n, Hq, D]`` in q's dtype.

    Raises:
        ValueError / TypeError on every rank: invalid inputs (see ``check_inputs``), or a
        ``backend`` other than ``"auto"`` / ``"reference"``.
    """
    problem = None
    if backend not in ("auto", "reference"):
        problem = (ValueError, f"backend must be 'auto' or 'reference' (the score matrix is built with plain "
                               f"PyTorch matmuls, the 'reference' backend, which is the baseline), got {backend!r}")
    ring, cfg = start("rsa", q, k, v, group=group, causal=causal, softmax_scale=softmax_scale,
                      layout=layout, backend="reference" if problem else backend, extra=problem)
    return _RingSelfAttn.apply(q, k, v, ring, cfg)


def bytes_formula(*, batch: int, local_seq: int, world_size: int, q_heads: int, kv_heads: int,
                  head_dim: int, dtype: torch.dtype) -> dict:
    """Bytes each rank sends per call: ``{"forward", "backward", "ops": {(phase, op): bytes}}``."""
    p, e, a = world_size, element_size(dtype), element_size(accum_dtype(dtype))
    block = batch * local_seq * kv_heads * head_dim  # elements of one K (or V) shard
    return byte_totals({("forward", "k"): (p - 1) * block * e, ("forward", "v"): (p - 1) * block * e,
                        ("forward", "meta"): meta_bytes(p), ("backward", "kv"): (p - 1) * 2 * block * e,
                        ("backward", "dkv"): (p if p > 1 else 0) * 2 * block * a})

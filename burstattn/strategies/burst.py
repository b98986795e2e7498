"""``strategy="burst"``: BurstAttention (the core ring; see :func:`burstattn.burst_attn_func`): a K/V ring
forward and a query-ring or K/V-ring backward (``backward="auto"``: fewer bytes wins), balanced layouts;
masks and partitions run the sparse direct schedule (:func:`burstattn.engine.direct.sparse_steps`). A
strategy module like the others (:mod:`burstattn.ops`): ``check``, ``plan_of``, ``forward``, ``backward``, ``fake``,
``bytes_formula``."""
from __future__ import annotations

from dataclasses import replace

import torch

from ..call.engine_adapter import backward_pass, forward_pass, step_policy
from ..call.prepare import prepare
from ..engine.bytes import accum_dtype, choose_backward, ring_bytes
from ..masks.setup import plan_for
from ..ops import run_call
from .base import check_call
from .local import local_backward, local_forward

EXACT_ALONE = (torch.float32, torch.float64)  # 16-bit: the engine's float32 tiles unless grad_partials="kernel"
GPU_KERNELS = ("sdpa", "flash_attn")  # 16-bit alone on CUDA: the kernel's own backward (see alone)


def run(q, k, v, keywords, fn=None):
    """``out [B, n, Hq, Dv]`` (and ``lse [B, Hq, n]`` with ``keywords.return_lse``) of one call with ``keywords``
    (a :class:`~burstattn.call.options.Keywords`: every keyword of :func:`burstattn.burst_attn_func`, which runs
    here too, as ``BurstAttention`` and ``attention(strategy="burst")`` do). ``fn``: the caller's name in
    messages (default ``attention(strategy='burst')``)."""
    out, lse = run_call(prepare("burst", q, k, v, keywords, fn=fn), q, k, v)
    return (out, lse) if keywords.return_lse else out


def check(call, q, k, v):
    """The cross-rank input check on every rank; the call with this rank's mask plan (``None``: dense)."""
    return replace(call, plan=check_call(call, q, k, v))


def plan_of(call, q, k):
    """This rank's mask plan over the group (``None`` for a dense call); checked in the forward already."""
    plan, problem = plan_for(q, call, call.where.rank, call.where.world_size, k.shape[1])
    if problem:
        raise problem[0](problem[1])
    return plan


def alone(call, q, k) -> bool:
    """Whether this call is one dense kernel block: a world of one, the same query and key length, no
    mask, score modifier or sinks, and gradient partials that the kernel's own backward produces exactly
    (float32 / float64, ``grad_partials="kernel"`` (the default ``"auto"`` on CUDA), or a GPU's cuDNN /
    flash kernel: one block has no partials to sum, and its float32-accumulated 16-bit gradients are flash-attn's own, the rule's
    reference; the float32 tiles would run it in float32, SDPA's memory-efficient kernel, 6-10x slower on
    an H200, bench/results/cuda). The engine would run the same single block through its loop (its copies, float32
    accumulators and merges), which costs 10-15% at 1,024 tokens on CPU."""
    w = call.where
    return ((w is None or w.world_size == 1) and call.plan is None and call.mask is None and call.alibi is None
            and call.sinks is None and not call.softcap and q.shape[1] == k.shape[1]
            and isinstance(call.layout, str) and (call.kv_layout is None or isinstance(call.kv_layout, str))
            and (q.dtype in EXACT_ALONE or step_policy(call, q, q).grad_partials == "kernel"
                 or (q.is_cuda and call.backend in GPU_KERNELS)))


def forward(call, q, k, v):
    """``out [B, n, Hq, Dv]`` (q's dtype) and the saved ``[lse [B, Hq, n]]`` (float32; float64 for float64;
    sinks included): :func:`burstattn.call.engine_adapter.forward_pass`, or one kernel call when :func:`alone`."""
    if alone(call, q, k):
        out, lse = local_forward(call, q, k, v)
        return out, [lse]
    out, lse = forward_pass(call.where, call, call.plan, q, k, v, call.alibi, call.sinks)
    return out, [lse]


def backward(call, dout, q, k, v, out, saved):
    """``dq, dk, dv`` (and ``dsinks [Hq]``, this rank's share, with sinks):
    :func:`burstattn.call.engine_adapter.backward_pass` (one kernel call when :func:`alone`)."""
    (lse,) = saved
    if alone(call, q, k):
        return local_backward(call, dout, q, k, v, out, lse)
    dq, dk, dv, dsinks = backward_pass(call.where, call, call.plan, dout, q, k, v, out, lse, alibi=call.alibi,
                                       sinks=call.sinks)
    return (dq, dk, dv) if dsinks is None else (dq, dk, dv, dsinks)


def fake(call, q, k, v):
    """Empty ``[out, lse]`` of :func:`forward` (shapes only)."""
    b, n, hq, _ = q.shape
    return [q.new_empty(b, n, hq, v.shape[-1]), q.new_empty(b, hq, n, dtype=accum_dtype(q.dtype))]


def bytes_formula(*, batch: int, local_seq: int, world_size: int, q_heads: int, kv_heads: int,
                  head_dim: int, dtype: torch.dtype, backward: str = "auto", kv_local_seq=None,
                  v_head_dim=None) -> dict:
    """Bytes each rank sends per call (:func:`burstattn.engine.bytes.ring_bytes`, ``"auto"`` resolved
    as :func:`burst_attn_func` resolves it)."""
    kw = dict(batch=batch, local_seq=local_seq, world_size=world_size, q_heads=q_heads, kv_heads=kv_heads,
              head_dim=head_dim, dtype=dtype, kv_local_seq=kv_local_seq, v_head_dim=v_head_dim)
    return ring_bytes(backward=choose_backward(**kw) if backward == "auto" else backward, **kw)

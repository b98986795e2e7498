"""``strategy="rsa"``: Ring Self-Attention (Li et al., 2021, "Sequence Parallelism"), the
baseline the BurstAttention paper calls RingAttention.

Forward, two rings (:func:`burstattn.engine.plan.ring` plans on the one loop,
:func:`burstattn.engine.loop.run_plan`, with this strategy's own compute):

1. K circulates (op ``k``); each step fills the columns of the visiting rank's keys in this
   rank's full score matrix ``S [B, Hq, n, N]`` (float32; float64 for float64 inputs), with
   the causal mask taken from the global positions of both shards
   (:func:`burstattn.layouts.named.local_positions`), so every layout is exact. Blocks the mask hides
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

from dataclasses import replace


import torch

from ..call.call import Call
from ..comm.groups import GroupContext
from ..comm.host import host_side
from ..comm.stats import active_stats
from ..comm.trace import active_trace
from ..comm.transport import pass_transport
from ..engine.bytes import accum_dtype, byte_totals, element_size, meta_bytes
from ..engine.loop import Partial, Whole, run_plan
from ..engine.pairs import ops_from_positions
from ..engine.plan import Channels, Key, Plan, ring
from ..kernels.base import row_dot
from ..layouts.named import local_positions
from ..ops import strategy_call
from .base import check_call

K_RING, V_RING, KV_RING = Channels(kv="k", dkv="k_acc"), Channels(kv="v", dkv="v_acc"), Channels()


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


class _SumAccs:
    """The backward's travelling dK/dV accumulator ``(dk, dv)`` per key owner, summed (``kv``: the
    shape and dtype of one owner's stacked block ``[2, B, Hkv, n, D]``)."""

    sides = frozenset({"kv"})

    def __init__(self, kv: torch.Tensor) -> None:
        self.kv = kv

    def fold(self, side, acc, c):
        parts = c.acc if isinstance(c, Whole) else c.tensors
        if acc is None:
            return tuple(x.clone() for x in parts)
        for a, x in zip(acc, parts):
            a.add_(x)
        return acc

    def wire(self, side, acc):
        return (torch.zeros_like(self.kv[0]), torch.zeros_like(self.kv[1])) if acc is None else acc

    def like(self, side):
        return torch.empty_like(self.kv[0]), torch.empty_like(self.kv[1])

    def received(self, side, acc, bufs):
        return bufs if acc is None else self.fold(side, acc, Whole(bufs))


class _NoAccs:
    """A ring whose steps only fill this rank's own buffers (nothing travels back)."""

    sides = frozenset()


def _plan(where: GroupContext, cfg: Call, n: int, channels: Channels) -> Plan:
    """The K/V ring of this rank over positions of ``cfg.layout`` (the pairs a causal mask leaves
    empty have no ops and are not computed)."""
    p = where.world_size
    with host_side():  # positions and plans are host-side (real tensors in a dry run too, as engine_pass's)
        pos = [local_positions(n * p, r, p, cfg.layout) for r in range(p)]
        return ring(where.rank, p, ops_from_positions(pos, pos, cfg.causal), "kv", channels=channels)


def _ring_of(where: GroupContext, comm, plan: Plan, block: torch.Tensor, compute, accs=_NoAccs()) -> dict:
    """Run one ring of ``plan`` with this rank's travelling ``block``; ``compute(owner, block)`` per step
    (an iterable of contributions to the owner's accumulator)."""
    def step(pair, data):
        return [(Key("kv", pair.k), c) for c in compute(pair, data[Key("kv", pair.k)][0])]
    return run_plan(comm, plan, {Key("kv", where.rank): (block,), Key("q", where.rank): ()}, step, accs)


def forward(call, q, k, v):
    """``out [B, n, Hq, D]`` and the saved ``[probs [B, Hkv, g, n, N], out [B, Hkv, g, n, D]]`` (both in
    the accumulator dtype): the K ring fills the scores, a row softmax, the V ring forms the output."""
    where = call.where
    b, n, hq, d = q.shape
    hkv, p, acc = k.shape[2], where.world_size, accum_dtype(q.dtype)
    scale = call.scale_for(d)
    qg = _grouped(q, hkv, acc)  # (B, Hkv, g, n, D)
    seq = n * p
    pos = [local_positions(seq, r, p, call.layout).to(q.device) for r in range(p)]
    scores = torch.full((b, hkv, hq // hkv, n, seq), float("-inf"), dtype=acc, device=q.device)

    def fill(pair, kb):  # kb (B, Hkv, n, D): keys of rank pair.k -> columns [k*n, (k+1)*n)
        if pair.ops:
            s = torch.matmul(qg, kb.to(acc).unsqueeze(2).transpose(-1, -2)).mul_(scale)  # (B, Hkv, g, n, n)
            if call.causal:
                s.masked_fill_(pos[pair.k][None, :] > pos[where.rank][:, None], float("-inf"))
            scores[..., pair.k * n:(pair.k + 1) * n] = s
        return ()

    comm = pass_transport(where, "forward", active_stats(), active_trace())
    # the loop sends this block on: (B, n, Hkv, D) -> (B, Hkv, n, D)
    _ring_of(where, comm, _plan(where, call, n, K_RING), k.transpose(1, 2).contiguous(), fill)
    # every row sees at least its own key, so the log-sum-exp is finite
    probs = scores.sub_(torch.logsumexp(scores, dim=-1, keepdim=True)).exp_()
    out = torch.zeros(qg.shape, dtype=acc, device=q.device)  # (B, Hkv, g, n, D)

    def apply(pair, vb):  # vb (B, Hkv, n, D)
        if pair.ops:
            out.add_(torch.matmul(probs[..., pair.k * n:(pair.k + 1) * n], vb.to(acc).unsqueeze(2)))
        return ()

    _ring_of(where, comm, _plan(where, call, n, V_RING), v.transpose(1, 2).contiguous(), apply)
    return _ungrouped(out, q.dtype), [probs, out]


def backward(call, dout, q, k, v, out_unused, saved):
    """``dq, dk, dv`` from the stored probabilities: a K/V ring with the dK/dV accumulator one step
    behind (ops ``kv``, ``dkv``); nothing is recomputed."""
    probs, out = saved
    where = call.where
    n, hkv = q.shape[1], k.shape[2]
    acc, scale = out.dtype, call.scale_for(q.shape[3])
    qg, dog = _grouped(q, hkv, acc), _grouped(dout, hkv, acc)  # (B, Hkv, g, n, D)
    delta = row_dot(dog, out, acc).unsqueeze(-1)  # D = rowsum(dO * O), (B, Hkv, g, n, 1)
    dq = torch.zeros_like(qg)

    def compute(pair, kv):  # kv (2, B, Hkv, n, D) of rank pair.k
        if not pair.ops:
            return ()
        p_blk = probs[..., pair.k * n:(pair.k + 1) * n]  # (B, Hkv, g, n, n)
        kb, vb = kv[0].to(acc).unsqueeze(2), kv[1].to(acc).unsqueeze(2)  # (B, Hkv, 1, n, D)
        ds = p_blk * (torch.matmul(dog, vb.transpose(-1, -2)) - delta)
        dq.add_(torch.matmul(ds, kb), alpha=scale)
        # (B, Hkv, g, n, D) -> (B, Hkv, n, D): sum over the query heads sharing a kv head
        return (Partial(slice(None), (torch.matmul(ds.transpose(-1, -2), qg).sum(2).mul_(scale),
                                      torch.matmul(p_blk.transpose(-1, -2), dog).sum(2))),)

    comm = pass_transport(where, "backward", active_stats(), active_trace())
    kv = torch.stack([k.transpose(1, 2), v.transpose(1, 2)])  # (2, B, Hkv, n, D)
    accs = _SumAccs(torch.zeros(kv.shape, dtype=acc, device=q.device))
    res = _ring_of(where, comm, _plan(where, call, n, KV_RING), kv, compute, accs)
    dk, dv = res.get(Key("kv", where.rank)) or accs.wire("kv", None)
    return _ungrouped(dq, q.dtype), dk.transpose(1, 2).to(k.dtype), dv.transpose(1, 2).to(v.dtype)


def check(call, q, k, v):
    """The input check on every rank (the backend was checked by :func:`run`)."""
    check_call(call, q, k, v, group_plan=False)
    return call


def plan_of(call, q, k):
    return None


def fake(call, q, k, v):
    """Empty ``[out, probs, out_acc]`` of :func:`forward` (shapes only)."""
    b, n, hq, d = q.shape
    hkv, p, acc = k.shape[2], call.where.world_size, accum_dtype(q.dtype)
    return [q.new_empty(b, n, hq, d), q.new_empty(b, hkv, hq // hkv, n, n * p, dtype=acc),
            q.new_empty(b, hkv, hq // hkv, n, d, dtype=acc)]


def run(q, k, v, keywords) -> torch.Tensor:
    """``q [B, n, Hq, D]``, ``k, v [B, n, Hkv, D]`` (this rank's shard in ``layout``) ->
    ``[B, n, Hq, D]`` in q's dtype.

    Raises:
        ValueError / TypeError on every rank: invalid inputs (see ``check_inputs``), or a
        ``backend`` other than ``"auto"`` / ``"reference"``.
    """
    problem, backend = None, keywords.backend
    if backend not in ("auto", "reference"):
        problem = (ValueError, f"backend must be 'auto' or 'reference' (the score matrix is built with plain "
                               f"PyTorch matmuls, the 'reference' backend, which is the baseline), got {backend!r}")
    return strategy_call("rsa", q, k, v, replace(keywords, backend="reference"), problem=problem)


def bytes_formula(*, batch: int, local_seq: int, world_size: int, q_heads: int, kv_heads: int,
                  head_dim: int, dtype: torch.dtype) -> dict:
    """Bytes each rank sends per call: ``{"forward", "backward", "ops": {(phase, op): bytes}}``."""
    p, e, a = world_size, element_size(dtype), element_size(accum_dtype(dtype))
    block = batch * local_seq * kv_heads * head_dim  # elements of one K (or V) shard
    return byte_totals({("forward", "k"): (p - 1) * block * e, ("forward", "v"): (p - 1) * block * e,
                        ("forward", "meta"): meta_bytes(p), ("backward", "kv"): (p - 1) * 2 * block * e,
                        ("backward", "dkv"): (p if p > 1 else 0) * 2 * block * a})

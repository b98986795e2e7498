"""The fused blockwise loss: each chunk's gradients computed in the forward, only scaled in the backward.

The unfused blockwise loss (:func:`.blockwise.blockwise_cross_entropy`) recomputes every chunk's
output projection in the backward (one more ``[chunk, dim] x [dim, vocab]`` product per chunk).
Liger-Kernel's fused linear cross-entropy, DeepSpeed ALST's tiled loss and BurstEngine's fused
head avoid that: while the chunk's logits exist in the forward, the gradient of the loss with
respect to them is known (``softmax - onehot``, over the targets), so the gradients with respect
to the head's input rows and to the output weight are computed right there:

    grad_logits = (exp(logits - lse) - onehot(label)) * valid / divisor      [c, V]
    grad_x[rows] = grad_logits @ W                                            [c, dim]
    grad_W      += grad_logits^T @ x[rows]                                    [V, dim], float32

and the backward only multiplies ``grad_x`` and ``grad_W`` by the incoming gradient (1 for
``loss.backward()``). Nothing is recomputed; the price is memory held from the forward to the
backward: ``grad_x`` (one hidden state, ``[B, rows, dim]``) and the float32 accumulator
``grad_W`` (``vocab x dim``, ``vocab / tp`` rows under tensor parallelism), which the simulator
counts (:func:`burstattn.sim.activations.head_kept`).

The final norm runs once over the whole local hidden state before the fused head (its ordinary
backward runs in the backward: it is elementwise and keeps only its input and ``rsqrt``). The weight's
gradient is produced once, as one tensor, by the backward of one autograd node: under FSDP2 the
unsharded weight's gradient reaches the reduce-scatter once (not once per chunk, as the
recomputed chunks do); tied embeddings add the embedding's gradient to the same parameter.

Tensor parallelism (the head column-parallel over the vocabulary, ``tp-v1`` / ``tp-v3``): every tp
rank holds all rows of the head's input (``tp-v3`` gathers the sequence shards of the normed
hidden state, in rank order: the labels' order) and ``vocab / tp`` rows of ``W``; the softmax's
max, sum and target logit are all-reduced over tp (the vocabulary-parallel cross-entropy of
Megatron), ``grad_W`` is the rank's own slice, and ``grad_x`` is a partial sum over tp that the
backward of the gather reduces (all-reduce under v1, reduce-scatter under v3).

Shapes: hidden states ``[B, m, dim]``, labels and answer masks ``[B, shards * m]``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..config import IGNORE_INDEX
from .blockwise import chunk_bounds


def _head_inputs(x: torch.Tensor, weight: torch.Tensor):
    """``(rows, w, group, offset)``: the plain local tensors the fused head works on. ``x`` (the
    normed hidden state; a sequence-sharded DTensor under tp-v3) -> all its rows ``[B, n, dim]``,
    whose gradient is declared a partial sum over tp; ``weight`` (a vocabulary-sharded DTensor under
    tp) -> its local rows ``[V / tp, dim]``; ``group``: the tp group (``None`` without tp) and
    ``offset``: the first vocabulary id of the local rows."""
    if not hasattr(weight, "to_local"):
        return (x.to_local() if hasattr(x, "to_local") else x), weight, None, 0
    from torch.distributed.tensor import DTensor, Partial, Replicate

    mesh = weight.device_mesh
    if not isinstance(x, DTensor):  # tp-v1: the rows are replicated over tp
        x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    rows = x.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
    local = weight.to_local()
    group = mesh.get_group()
    return rows, local, group, dist.get_rank(group) * local.shape[0]


def _chunk(raw: torch.Tensor, labels: torch.Tensor, offset: int, group, scale: float,
           answer: Optional[torch.Tensor], softcap: Optional[float] = None):
    """One chunk's ``(ce [c] float32, grad [c, V_local] float32, stats [2] float64)`` from the head's
    output ``raw [c, V_local]`` (float32; the logits are ``softcap * tanh(raw / softcap)`` when
    ``softcap``, else ``raw``), ``labels [c]`` (global vocabulary ids or ``IGNORE_INDEX``); ``grad`` is
    the gradient with respect to ``raw`` of ``scale * sum(ce)``."""
    logits = raw if not softcap else softcap * torch.tanh(raw / softcap)
    vl = logits.shape[1]
    mx = logits.max(-1).values
    if group is not None:
        dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - mx[:, None]
    sumexp = shifted.exp().sum(-1)
    valid = labels != IGNORE_INDEX
    local = labels - offset
    inside = valid & (local >= 0) & (local < vl)
    target = torch.where(inside, logits.gather(1, local.clamp(0, vl - 1)[:, None]).squeeze(1), 0.0)
    if group is not None:
        both = torch.stack([sumexp, target])
        dist.all_reduce(both, group=group)
        sumexp, target = both[0], both[1]
    lse = mx + sumexp.log()
    ce = torch.where(valid, lse - target, 0.0)
    grad = (logits - lse[:, None]).exp_()  # softmax
    # minus one at each row's own target (rows whose target is another rank's add -0.0: unchanged), with
    # no data-dependent shape (no nonzero: a dry run's fake tensors could not follow it)
    grad.scatter_add_(1, local.clamp(0, vl - 1)[:, None], -inside.to(grad.dtype)[:, None])
    grad.mul_((valid.to(grad.dtype) * scale)[:, None])
    if softcap:  # d(softcap * tanh(raw / softcap)) / d(raw) = 1 - tanh^2
        grad.mul_(1.0 - (logits / softcap).square())
    if answer is None:
        return ce, grad, torch.zeros(2, dtype=torch.float64, device=ce.device)
    with torch.no_grad():
        best = logits.max(-1)
        if group is None:
            pick = best.indices
        else:  # the global argmax (the first index of the global max, as torch.argmax)
            pick = torch.where(best.values == mx, best.indices + offset, torch.full_like(best.indices, 1 << 62))
            dist.all_reduce(pick, op=dist.ReduceOp.MIN, group=group)
        hit = (pick == labels) & answer
        stats = torch.stack([hit.sum().double(), (ce.double() * answer).sum()])
    return ce, grad, stats


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """``(x [B, n, dim], w [V_local, dim]) -> sum(CE of the targets) / divisor`` (float32 scalar) and
    the detached answer stats; the gradients are computed in the forward (see the module)."""

    @staticmethod
    def forward(ctx, x, w, labels, answer, chunk: int, divisor: float, group, offset: int,
                softcap: Optional[float] = None):
        b, n, dim = x.shape
        grad_x = torch.empty_like(x)
        grad_w = torch.zeros(w.shape, dtype=torch.promote_types(w.dtype, torch.float32), device=w.device)
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        stats = torch.zeros(2, dtype=torch.float64, device=x.device)
        scale = 1.0 / divisor
        for a, e in chunk_bounds(n, chunk):
            xc = x[:, a:e].reshape(-1, dim)  # [B * c, dim]
            logits = (xc @ w.t()).to(grad_w.dtype)  # [B * c, V_local], in at least float32
            ans = None if answer is None else answer[:, a:e].reshape(-1)
            ce, grad, st = _chunk(logits, labels[:, a:e].reshape(-1), offset, group, scale, ans, softcap)
            del logits
            total = total + ce.sum()
            stats = stats + st
            grad_x[:, a:e] = (grad.to(x.dtype) @ w).view(b, e - a, dim)
            if grad_w.dtype == xc.dtype:
                grad_w.addmm_(grad.t(), xc)
            else:  # low precision: the product in the weight's dtype, accumulated in float32
                grad_w.add_(grad.to(w.dtype).t() @ xc)
        ctx.save_for_backward(grad_x, grad_w)
        ctx.w_dtype = w.dtype
        ctx.mark_non_differentiable(stats)
        return total / divisor, stats

    @staticmethod
    def backward(ctx, grad_loss, _grad_stats):
        grad_x, grad_w = ctx.saved_tensors
        return (grad_x * grad_loss.to(grad_x.dtype), (grad_w * grad_loss).to(ctx.w_dtype)) + (None,) * 7


def fused_cross_entropy(norm, weight: torch.Tensor, hidden: torch.Tensor, labels: torch.Tensor, *, chunk: int,
                        divisor: float, answer: Optional[torch.Tensor] = None,
                        shards: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``sum(next-token CE over the targets of labels [B, shards*m]) / divisor`` for ``hidden [B, m, dim]``
    through ``norm`` and the output projection ``weight [vocab, dim]`` (a vocabulary-sharded DTensor
    under tensor parallelism), over chunks of ``chunk`` local rows (0: one chunk), with the gradients
    computed in the forward (see the module). Returns ``(loss, stats)``: ``loss`` a differentiable
    float32 scalar; ``stats`` float64 ``[hits, ce_sum]`` over the ``answer [B, shards*m]`` positions
    (zeros when ``answer`` is None), detached: the same as :func:`.blockwise.blockwise_cross_entropy`
    (its ``ce_sum / divisor``).
    """
    rows, w, group, offset = _head_inputs(norm(hidden), weight)
    if rows.shape[1] != labels.shape[1]:
        raise ValueError(f"fused_cross_entropy: the head's {rows.shape[1]} rows do not match labels "
                         f"{tuple(labels.shape)}")
    loss, stats = _FusedLinearCrossEntropy.apply(rows, w, labels, answer, chunk * shards, float(divisor), group,
                                                 offset)
    return loss, stats


def fused_linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, chunk: int,
                               divisor: float = 1.0, softcap: Optional[float] = None) -> torch.Tensor:
    """``sum(CE of the targets of labels [B, n]) / divisor`` of the logits ``x [B, n, dim] @ weight.T``
    (``weight [vocab, dim]`` plain; logits in at least float32, capped by ``softcap * tanh(. / softcap)``
    when ``softcap``) over chunks of ``chunk`` rows (0: one chunk), the gradients computed in the
    forward: a differentiable float32 scalar (the Hugging Face path's fused head,
    :func:`burstattn.hf.causal_lm_loss`)."""
    loss, _ = _FusedLinearCrossEntropy.apply(x, weight, labels, None, chunk, float(divisor), None, 0, softcap)
    return loss

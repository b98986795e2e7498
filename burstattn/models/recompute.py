"""Run a function keeping only its input tensors for the backward, which reruns it (a checkpoint
as an autograd Function: it also keeps only its inputs when it runs inside another checkpoint's
recomputation, where a nested ``torch.utils.checkpoint`` keeps everything). A function of each
token alone reruns a block of tokens at a time, so its backward's transients stay small."""
from __future__ import annotations

from typing import Callable

import torch


def kept_inputs(fn: Callable, *tensors: torch.Tensor, per_token: int = 0, rows: int = 1024) -> torch.Tensor:
    """``fn(*tensors)`` (one tensor out); the backward reruns ``fn`` with the graph on and
    differentiates it.

    ``fn`` must reach every parameter it uses through ``tensors`` (their gradients are returned,
    not accumulated), draw no random numbers, and run collectives in the same order on every rank
    (the backward reruns them). ``per_token > 0``: the first ``per_token`` tensors are ``[B, n, ...]``,
    the output ``[B, n, ...]`` and token ``t``'s output depends only on token ``t``'s rows (the rest
    are parameters): the backward reruns ``rows`` tokens at a time. Without gradients: ``fn(*tensors)``."""
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors):
        return fn(*tensors)
    return _KeptInputs.apply(fn, per_token, rows, *tensors)


class _KeptInputs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, per_token, rows, *tensors):
        ctx.fn, ctx.per_token, ctx.rows = fn, per_token, rows
        ctx.save_for_backward(*tensors)
        with torch.no_grad():
            return fn(*tensors)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        saved, want = ctx.saved_tensors, ctx.needs_input_grad[3:]
        k = ctx.per_token
        n = saved[0].shape[1] if k else 1
        step = ctx.rows if k else 1
        grads = [torch.zeros_like(t) if w else None for t, w in zip(saved, want)]
        for a in range(0, n, step):
            leaves = [(t[:, a:a + step] if i < k else t).detach().requires_grad_(w)
                      for i, (t, w) in enumerate(zip(saved, want))]
            with torch.enable_grad():
                out = ctx.fn(*leaves)
            got = list(torch.autograd.grad(out, [t for t in leaves if t.requires_grad],
                                           grad[:, a:a + step] if k else grad, allow_unused=True))
            for i, t in enumerate(leaves):
                if t.requires_grad:
                    g = got.pop(0)
                    if g is not None:
                        (grads[i][:, a:a + step] if i < k else grads[i]).add_(g)
        return (None, None, None, *grads)

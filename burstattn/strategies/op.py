"""Every strategy behind the custom op: :func:`strategy_call`, the one entry of ulysses, usp, tp,
allgather and rsa into ``torch.ops.burstattn.strategy_fwd`` (registered in :mod:`burstattn.ops`).

``burst`` and ``ring`` run as ``attention_fwd``; the others as ``strategy_fwd`` / ``strategy_bwd``, so
``torch.compile(fullgraph=True)`` captures them and selective-checkpoint policies see them
(:data:`burstattn.ops.SAVED_OPS`). The Python before the op only reads shapes and option values; the
cross-rank input check runs inside the op, on every call. A strategy module provides
``check(call, q, k, v) -> call`` (the collective input check, returning the call with its mask plan),
``plan_of(call, q, k)`` (that plan again, pure: for the backward), ``forward(call, q, k, v) -> (out,
saved)``, ``backward(call, dout, q, k, v, out, saved) -> (dq, dk, dv)`` and ``fake(call, q, k, v) ->
[out, *saved]`` (empty tensors of the right shapes). A ``mask_mod`` (a Python function) cannot be an
op argument: such calls run the same functions in the eager :class:`StrategyFunction`.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..autograd import refuse_double_backward, without_autocast
from ..config import AttnConfig
from ..groups import group_context
from ..masks.setup import build_mask
from ..ops import Call, strategy_arguments, strategy_module
from ..validate import check_inputs, local_problem, runs_backward, scale_value
from .base import label, one_sequence_problem

__all__ = ["strategy_call", "StrategyFunction"]


class StrategyFunction(torch.autograd.Function):
    """The same forward and backward, eager: for calls the op cannot carry (a ``mask_mod``). The call
    is already checked. Second-order gradients are refused."""

    @staticmethod
    @without_autocast
    def forward(ctx, q, k, v, call: Call):
        mod = strategy_module(call.strategy)
        out, saved = mod.forward(call, q, k, v)
        ctx.save_for_backward(q, k, v, out, *saved)
        ctx.call = call
        return out

    @staticmethod
    @without_autocast
    def backward(ctx, dout):
        refuse_double_backward()
        q, k, v, out, *saved = ctx.saved_tensors
        dq, dk, dv = strategy_module(ctx.call.strategy).backward(ctx.call, dout, q, k, v, out, saved)
        return dq, dk, dv, None


def strategy_call(name: str, q, k, v, *, group, causal, softmax_scale, layout, backend: str = "auto",
                  backward: str = "auto", mask_args: Optional[dict] = None, options: Optional[dict] = None,
                  problem: Optional[tuple[type, str]] = None) -> torch.Tensor:
    """One call of strategy ``name`` through the op (eagerly with a ``mask_mod``). ``problem``: what the
    strategy found wrong on this rank (raised on every rank by the input check); ``options``: the
    strategy's own (ints and strings). Traceable up to the op: only shapes and option values are read."""
    where = group_context(group)
    amask, mask_problem = build_mask(**(mask_args or {}))
    cfg = AttnConfig(causal=causal, softmax_scale=scale_value(softmax_scale), layout=layout, backend=backend,
                     backward=backward, mask=amask, grad=runs_backward(q, k, v))
    tensors = all(isinstance(x, torch.Tensor) for x in (q, k, v))
    problem = problem or mask_problem or one_sequence_problem(name, q, k, v)
    if problem is None and tensors:
        problem = local_problem(q, k, v, cfg)
    call = Call(where, cfg, label(name), name, dict(options or {}))
    if problem is not None or not tensors:
        check_inputs(q, k, v, cfg, where.group, where.world_size, fn=call.fn, extra=problem)  # raises on every rank
    if amask is not None and amask.mask_mod is not None:
        return StrategyFunction.apply(q, k, v, strategy_module(name).check(call, q, k, v))
    group_arg, spec, positions, bounds = strategy_arguments(call)
    return torch.ops.burstattn.strategy_fwd(q, k, v, group_arg, spec, positions, bounds)[0]

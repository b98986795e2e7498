"""The registered custom ops of every strategy: what ``torch.compile`` and checkpoint policies see.

One op pair serves every strategy (burst, ring, rsa, ulysses, allgather, usp, tp):

* ``torch.ops.burstattn.attention_fwd(q, k, v, alibi, sinks, spec, tensors) -> [out, *saved]``: the
  cross-rank input check, then the strategy's forward.
* ``torch.ops.burstattn.attention_bwd(dout, q, k, v, out, saved, alibi, sinks, spec, tensors) -> [dq, dk,
  dv, dsinks]``: the strategy's backward; registered as the
  forward's autograd formula (``dsinks`` is empty without sinks). Its own derivative raises:
  second-order gradients are not supported.

``spec`` names the strategy; its module (``burstattn.strategies.NAME``) provides ``check`` (the
cross-rank input check, inside the op), ``plan_of``, ``forward`` (``out`` and ``saved``: what its backward
needs besides the inputs, outputs without a gradient; burst and ring save the LSE), ``backward`` and
``fake`` (the shapes of ``[out, *saved]``); see :mod:`burstattn.call.prepare`.

The :class:`~burstattn.call.Call` crosses generically (:mod:`burstattn.call.boundary`): every field in
``spec`` (a constant string for the compiler; the process group by its name), the tensors of its typed
values in ``tensors`` (a partition's positions ``[P, n]``, a document mask's bounds ``[D + 1]``, int64).
ALiBi slopes (``[Hq]`` / ``[B, Hq]``) and sink logits (``[Hq]``) are tensor arguments of their own
(``None`` when absent; the sinks get a gradient). A ``mask_mod`` (a Python function) cannot be an op argument: such calls run the eager
:class:`~burstattn.ops.EagerCall` instead (the same functions; they work, but graph-break
under compile).

Validation under ``torch.compile``: the cross-rank check (one all-gather of a signature, plus
``.item()``-like reads) runs *inside* ``attention_fwd``'s implementation, i.e. at run time on
concrete tensors, on every call, compiled or not; the traced Python before the op only reads
shapes and option values. So ``fullgraph=True`` holds and no check is skipped.

Checkpointing: :func:`remat_policy` / :func:`save_attention_context` give the selective
checkpoint policy of DistFlashAttn's rematerialization-aware checkpointing: the attention
output is saved (``MUST_SAVE`` on :data:`attention_fwd`), everything else is recomputed, so the
recomputation of a checkpointed block never reruns the distributed forward.
"""
from __future__ import annotations

import sys
from dataclasses import replace
from importlib import import_module
from typing import Callable, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .call.boundary import STRATEGY_AT, call_from, decode_spec, op_arguments, shapes_call
from .call.call import Call
from .call.engine_adapter import DOUBLE_BACKWARD, refuse_double_backward, without_autocast
from .call.prepare import prepare
from .comm.stats import active_stats
from .comm.trace import active_trace

__all__ = ["attention_fwd", "attention_bwd", "Call", "remat_policy", "save_attention_context", "SAVED_OPS",
           "call_op", "run_call", "EagerCall"]


def __getattr__(name: str):
    # names that moved out of this module (the table burstattn.MOVED): refused with the new spelling
    return sys.modules["burstattn"].moved_attribute(__name__, name)


def owned(outputs: list[torch.Tensor], inputs) -> list[torch.Tensor]:
    """``outputs`` made contiguous (the strides the fake implementations promise) and sharing no
    memory with ``inputs`` or with each other (a custom op's outputs may not alias)."""
    # storages by identity, not data_ptr: a fake tensor's (the dry run's) has none
    seen = {StorageWeakRef(x.untyped_storage()) for x in inputs if x is not None}
    result = []
    for t in outputs:
        t = t.contiguous()
        ptr = StorageWeakRef(t.untyped_storage())
        if ptr in seen:
            t = t.clone()
            ptr = StorageWeakRef(t.untyped_storage())
        seen.add(ptr)
        result.append(t)
    return result


def strategy_module(name: str):
    """The module of strategy ``name`` (``burstattn.strategies.NAME``): the op's implementations are
    looked up by the name in the op's spec, as ``torch.ops`` looks ops up by theirs."""
    return sys.modules.get(f"burstattn.strategies.{name}") or import_module(f"burstattn.strategies.{name}")


@torch.library.custom_op("burstattn::attention_fwd", mutates_args=())
def attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, alibi: Optional[torch.Tensor],
                  sinks: Optional[torch.Tensor], spec: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Check the call on every rank, then run its strategy's forward: ``q [B, n, Hq, D]``,
    ``k [B, n_k, Hkv, D]``, ``v [B, n_k, Hkv, Dv]`` -> ``[out [B, n, Hq, Dv] (q's dtype), *saved]`` (what
    its backward needs; burst and ring: ``[lse [B, Hq, n]]``, float32, float64 for float64)."""
    call = call_from(spec, tensors, alibi, sinks)
    mod = strategy_module(call.strategy)
    call = mod.check(call, q, k, v)
    out, saved = without_autocast(mod.forward)(call, q, k, v)
    return owned([out, *saved], (q, k, v, alibi, sinks))


@attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, alibi, sinks, spec, tensors):
    # shapes only: the strategy, its options and the group size (no mask is built from fake tensors)
    call = shapes_call(spec, alibi, sinks)
    return strategy_module(call.strategy).fake(call, q, k, v)


def grads_of(mod, call: Call, dout, q, k, v, out, saved) -> list[torch.Tensor]:
    """``[dq, dk, dv, dsinks]`` of a call's backward (``dsinks``: empty without sinks; this rank's share,
    in the sinks' dtype)."""
    grads = list(without_autocast(mod.backward)(call, dout, q, k, v, out, list(saved)))
    if len(grads) == 3:
        grads.append(q.new_empty(0))
    elif call.sinks is not None:
        grads[3] = grads[3].to(call.sinks.dtype)
    return grads


@torch.library.custom_op("burstattn::attention_bwd", mutates_args=())
def attention_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  saved: list[torch.Tensor], alibi: Optional[torch.Tensor], sinks: Optional[torch.Tensor],
                  spec: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The strategy's backward: ``[dq, dk, dv]`` in the inputs' shapes and dtypes and ``dsinks [Hq]``
    (sinks' dtype; empty without sinks)."""
    call = call_from(spec, tensors, alibi, sinks)
    mod = strategy_module(call.strategy)
    call = replace(call, plan=mod.plan_of(call, q, k))  # checked in the forward already
    grads = grads_of(mod, call, dout, q, k, v, out, saved)
    return owned(grads, (dout, q, k, v, out, *saved, alibi, sinks, *tensors))


@attention_bwd.register_fake
def _attention_bwd_fake(dout, q, k, v, out, saved, alibi, sinks, spec, tensors):
    dsinks = q.new_empty(0) if sinks is None else sinks.new_empty(sinks.shape)
    return [q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks]


def _shape_only(x: torch.Tensor) -> torch.Tensor:
    """A stand-in of ``x`` with its shape, dtype and device and one element of storage (stride 0)."""
    return x.new_zeros(()).expand(x.shape)


def _setup_fwd(ctx, inputs, output) -> None:
    q, k, v, alibi, sinks, spec, tensors = inputs
    out, *saved = output
    ctx.mark_non_differentiable(*saved)
    ctx.set_materialize_grads(False)  # no zero gradients for the saved outputs (the LSE, or as large as q, k, v)
    if not getattr(strategy_module(decode_spec(spec)[STRATEGY_AT]), "BACKWARD_READS_INPUTS", True):
        # its backward reads only the shapes and dtypes of q, k, v and out: keep no copy of them alive
        q, k, v, out = (_shape_only(x) for x in (q, k, v, out))
    optional = [t for t in (alibi, sinks) if t is not None]
    ctx.save_for_backward(q, k, v, out, *saved, *optional, *tensors)
    ctx.counts, ctx.spec = (len(saved), len(optional)), spec
    ctx.has = (alibi is not None, sinks is not None)


def _backward_fwd(ctx, grads):
    if torch.is_grad_enabled():  # create_graph=True: the saved stand-ins (shapes only) carry no graph to refuse on
        raise RuntimeError(DOUBLE_BACKWARD)
    q, k, v, out, *rest = ctx.saved_tensors
    n_saved, n_optional = ctx.counts
    saved, optional, tensors = rest[:n_saved], iter(rest[n_saved:n_saved + n_optional]), rest[n_saved + n_optional:]
    alibi, sinks = (next(optional) if has else None for has in ctx.has)
    dq, dk, dv, dsinks = attention_bwd(grads[0], q, k, v, out, saved, alibi, sinks, ctx.spec, list(tensors))
    return dq, dk, dv, None, dsinks if sinks is not None else None, None, [None] * len(tensors)


def _setup_bwd(ctx, inputs, output) -> None:
    pass


def _refuse_double_backward(ctx, *grads):
    raise RuntimeError(DOUBLE_BACKWARD)


attention_fwd.register_autograd(_backward_fwd, setup_context=_setup_fwd)
attention_bwd.register_autograd(_refuse_double_backward, setup_context=_setup_bwd)


def call_op(call: Call, q, k, v) -> list[torch.Tensor]:
    """``[out, *saved]`` of a prepared call through the custom op (the cross-rank check inside)."""
    return torch.ops.burstattn.attention_fwd(q, k, v, call.alibi, call.sinks, *op_arguments(call))


class EagerCall(torch.autograd.Function):
    """The op's forward and backward, eager: for calls the op cannot carry (a ``mask_mod``). The call is
    checked in the forward (as inside the op). The backward records into the meter and trace active
    during the forward when none is active (a backward in another thread). Second-order gradients are
    refused."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, call: Call):
        mod = strategy_module(call.strategy)
        call = mod.check(replace(call, sinks=sinks), q, k, v)
        out, saved = without_autocast(mod.forward)(call, q, k, v)
        out, *saved = owned([out, *saved], (q, k, v, sinks))  # out may be a saved tensor (ulysses at world 1)
        ctx.mark_non_differentiable(*saved)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, out, *saved)
        ctx.call, ctx.meters = call, (active_stats(), active_trace())
        return (out, *saved)

    @staticmethod
    def backward(ctx, dout, *_):
        refuse_double_backward()
        from .comm import stats, trace

        q, k, v, out, *saved = ctx.saved_tensors
        call = ctx.call
        tokens = [(var, var.set(meter)) for var, meter in zip((stats._ACTIVE, trace._ACTIVE), ctx.meters)
                  if meter is not None and var.get() is None]
        try:
            dq, dk, dv, dsinks = grads_of(strategy_module(call.strategy), call, dout, q, k, v, out, saved)
        finally:
            for var, token in tokens:
                var.reset(token)
        return dq, dk, dv, dsinks if call.sinks is not None else None, None


def run_call(call: Call, q, k, v) -> list[torch.Tensor]:
    """``[out, *saved]`` of a prepared call: the custom op, or :class:`EagerCall` with a ``mask_mod``."""
    if call.mask is not None and call.mask.mask_mod is not None:
        return list(EagerCall.apply(q, k, v, call.sinks, call))
    return call_op(call, q, k, v)


def strategy_call(name: str, q, k, v, keywords, **kwargs) -> torch.Tensor:
    """``out`` of one call of strategy ``name`` with ``keywords`` (a :class:`~burstattn.call.options.Keywords`;
    ``kwargs``: :func:`prepare`'s own, ``options``, ``problem``)."""
    return run_call(prepare(name, q, k, v, keywords, **kwargs), q, k, v)[0]


# ------------------------------------------------------------------------------ checkpointing
# what the remat policy never recomputes: the distributed forwards
SAVED_OPS = (torch.ops.burstattn.attention_fwd.default,)


def remat_policy(extra_saved: tuple = ()) -> Callable:
    """DistFlashAttn's rematerialization-aware policy for selective activation checkpointing:
    ``MUST_SAVE`` for the distributed attention forward (and the ops in ``extra_saved``),
    ``PREFER_RECOMPUTE`` for everything else. Use with :func:`save_attention_context`, or::

        create_selective_checkpoint_contexts(remat_policy())
    """
    from torch.utils.checkpoint import CheckpointPolicy

    saved = SAVED_OPS + tuple(extra_saved)

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def save_attention_context(extra_saved: tuple = ()) -> Callable:
    """The ``context_fn`` for ``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False,
    context_fn=save_attention_context())``: recomputation skips the distributed attention."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    policy = remat_policy(extra_saved)
    return lambda: create_selective_checkpoint_contexts(policy)

"""The registered custom ops of every strategy: what ``torch.compile`` and checkpoint policies see.

One op pair serves every strategy (burst, ring, rsa, ulysses, allgather, usp, tp):

* ``torch.ops.burstattn.attention_fwd(q, k, v, alibi, sinks, group, spec, positions, kv_positions, bounds,
  kv_bounds) -> [out, *saved]``: the cross-rank input check, then the strategy's forward.
* ``torch.ops.burstattn.attention_bwd(dout, q, k, v, out, saved, alibi, sinks, group, spec, positions,
  kv_positions, bounds, kv_bounds) -> [dq, dk, dv, dsinks]``: the strategy's backward; registered as the
  forward's autograd formula (``dsinks`` is empty without sinks). Its own derivative raises:
  second-order gradients are not supported.

``spec`` names the strategy; its module (``burstattn.strategies.NAME``) provides ``check`` (the
cross-rank input check, inside the op), ``plan_of``, ``forward`` (``out`` and ``saved``: what its backward
needs besides the inputs, outputs without a gradient; burst and ring save the LSE), ``backward`` and
``fake`` (the shapes of ``[out, *saved]``); see :mod:`burstattn.strategies.op`.

The process group travels by name (``group.group_name``; ``""`` for a world of one) and every other
option in ``spec``, a string of :class:`OpSpec` (a constant for the compiler). ALiBi slopes
(``[Hq]`` / ``[B, Hq]``) and sink logits (``[Hq]``) are tensor arguments (``None`` when absent; the
sinks get a gradient). A partition layout travels as ``positions [P, n]`` (int64; the keys'
``kv_positions``), a document mask as ``bounds [D + 1]`` (int64; the keys' ``kv_bounds``).
A ``mask_mod`` (a Python function) cannot be an op argument: such calls run the eager
:class:`~burstattn.strategies.op.EagerCall` instead (the same functions; they work, but graph-break
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

from dataclasses import dataclass, replace
from importlib import import_module
from typing import Callable, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .autograd import DOUBLE_BACKWARD, without_autocast
from .config import AttnConfig, OpSpec
from .formulas import accum_dtype
from .groups import GroupContext, TwoLevelGroups, group_name, named_context, resolve_group
from .masks.setup import data_mask

__all__ = ["attention_fwd", "attention_bwd", "OpSpec", "Call", "remat_policy", "save_attention_context", "SAVED_OPS",
           "call_op"]


def _layout_arg(layout):
    """``(name, positions [P, n] or None)`` of a layout name or a partition."""
    if isinstance(layout, str):
        return layout, None
    return f"partition:{layout.name}", torch.stack(list(layout.positions))


def op_arguments(where: GroupContext, cfg: AttnConfig, fn: str, strategy: str = "burst",
                 options: Optional[list] = None):
    """``(group, spec, positions, kv_positions, bounds, kv_bounds)`` of the ops for a resolved ``cfg``
    whose mask, if any, has no ``mask_mod`` (``strategy``, ``options``: see :class:`OpSpec`)."""
    mask, topo = cfg.mask, cfg.topology
    layout, positions = _layout_arg(cfg.layout)
    kv_layout, kv_positions = (None, None) if cfg.kv_layout is None else _layout_arg(cfg.kv_layout)
    spec = OpSpec(fn, cfg.causal, cfg.softmax_scale, layout, cfg.backend, cfg.backward, cfg.schedule,
                  None if topo is None else [g.group_name if g is not None else "" for g in
                                             (topo.inner_group, topo.outer_group)] + [topo.ranks_per_node, topo.nodes],
                  None if mask is None or mask.window is None else list(mask.window),
                  mask is not None and mask.bounds is not None, 256 if mask is None else mask.block_size,
                  kv_layout, cfg.softcap, cfg.deterministic, cfg.grad_partials, strategy, options, cfg.grad)
    bounds = mask.bounds if spec.documents else None
    kv_bounds = mask.kv_bounds if spec.documents else None
    return group_name(where.group), spec.encode(), positions, kv_positions, bounds, kv_bounds


def call_of(group: str, spec: str, positions: Optional[torch.Tensor], kv_positions: Optional[torch.Tensor],
            bounds: Optional[torch.Tensor], kv_bounds: Optional[torch.Tensor], alibi: bool = False,
            sinks: bool = False) -> tuple[GroupContext, AttnConfig, str]:
    """The inverse of :func:`op_arguments`: ``(where, cfg, fn)``."""
    from .partition import Partition

    s = OpSpec.decode(spec)
    where = named_context(group)

    def layout_of(name, pos):
        if name is not None and name.startswith("partition:"):
            return Partition(tuple(pos.cpu().unbind(0)), name=name.split(":", 1)[1])
        return name
    layout, kv_layout = layout_of(s.layout, positions), layout_of(s.kv_layout, kv_positions)
    mask = None
    if s.window is not None or s.documents or positions is not None or kv_positions is not None:
        # the same object for the same definition (an empty one for a bare partition): the block
        # summaries it caches outlive the call
        mask = data_mask(s.window, bounds if s.documents else None, s.block_size,
                         kv_bounds if s.documents else None)
    topo = None
    if s.topology is not None:
        inner, outer, per_node, nodes = s.topology
        topo = TwoLevelGroups(resolve_group(inner), resolve_group(outer), per_node, nodes)
    cfg = AttnConfig(causal=s.causal, softmax_scale=s.softmax_scale, layout=layout, backend=s.backend,
                     backward=s.backward, schedule=s.schedule, mask=mask, topology=topo, kv_layout=kv_layout,
                     softcap=s.softcap, alibi=alibi, sinks=sinks, deterministic=s.deterministic,
                     grad_partials=s.grad_partials, grad=s.grad)
    return where, cfg, s.fn


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


@dataclass(frozen=True)
class Call:
    """One attention call, everything but q, k and v: where it runs, its config (resolved backend and
    backward, the mask), the caller's name for messages, the strategy and its own options (ints and
    strings), the optional tensors (ALiBi slopes ``[Hq]`` / ``[B, Hq]``, sink logits ``[Hq]``), and
    (after its check) this rank's mask plan. Built and checked once per call
    (:func:`burstattn.strategies.op.prepare`); crosses the op boundary as :func:`op_arguments`."""

    where: GroupContext
    cfg: AttnConfig
    fn: str
    strategy: str
    options: dict
    plan: Optional[object] = None
    alibi: Optional[torch.Tensor] = None
    sinks: Optional[torch.Tensor] = None


def strategy_module(name: str):
    """The module of strategy ``name`` (``burstattn.strategies.NAME``): the op's implementations are
    looked up by the name in the op's spec, as ``torch.ops`` looks ops up by theirs."""
    return import_module(f"burstattn.strategies.{name}")


def call_arguments(call: Call) -> tuple:
    """``(group, spec, positions, kv_positions, bounds, kv_bounds)`` of the op for a call (its mask has no
    ``mask_mod``)."""
    options = [[name, value] for name, value in sorted(call.options.items())]
    return op_arguments(call.where, call.cfg, call.fn, call.strategy, options)


def call_from(group: str, spec: str, positions, kv_positions, bounds, kv_bounds, alibi=None, sinks=None) -> Call:
    """The inverse of :func:`call_arguments` (with the op's optional tensors)."""
    where, cfg, fn = call_of(group, spec, positions, kv_positions, bounds, kv_bounds, alibi is not None,
                             sinks is not None)
    s = OpSpec.decode(spec)
    return Call(where, cfg, fn, s.strategy, dict(s.options or ()), alibi=alibi, sinks=sinks)


@torch.library.custom_op("burstattn::attention_fwd", mutates_args=())
def attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, alibi: Optional[torch.Tensor],
                  sinks: Optional[torch.Tensor], group: str, spec: str, positions: Optional[torch.Tensor],
                  kv_positions: Optional[torch.Tensor], bounds: Optional[torch.Tensor],
                  kv_bounds: Optional[torch.Tensor]) -> list[torch.Tensor]:
    """Check the call on every rank, then run its strategy's forward: ``q [B, n, Hq, D]``,
    ``k [B, n_k, Hkv, D]``, ``v [B, n_k, Hkv, Dv]`` -> ``[out [B, n, Hq, Dv] (q's dtype), *saved]`` (what
    its backward needs; burst and ring: ``[lse [B, Hq, n]]``, float32, float64 for float64)."""
    call = call_from(group, spec, positions, kv_positions, bounds, kv_bounds, alibi, sinks)
    mod = strategy_module(call.strategy)
    call = mod.check(call, q, k, v)
    out, saved = without_autocast(mod.forward)(call, q, k, v)
    return owned([out, *saved], (q, k, v, alibi, sinks))


@attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, alibi, sinks, group, spec, positions, kv_positions, bounds, kv_bounds):
    # shapes only: the strategy, its options and the group size (no mask is built from fake tensors)
    s = OpSpec.decode(spec)
    call = Call(named_context(group), None, s.fn, s.strategy, dict(s.options or ()), alibi=alibi, sinks=sinks)
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
                  group: str, spec: str, positions: Optional[torch.Tensor], kv_positions: Optional[torch.Tensor],
                  bounds: Optional[torch.Tensor], kv_bounds: Optional[torch.Tensor]) -> list[torch.Tensor]:
    """The strategy's backward: ``[dq, dk, dv]`` in the inputs' shapes and dtypes and ``dsinks [Hq]``
    (sinks' dtype; empty without sinks)."""
    call = call_from(group, spec, positions, kv_positions, bounds, kv_bounds, alibi, sinks)
    mod = strategy_module(call.strategy)
    call = replace(call, plan=mod.plan_of(call, q, k))  # checked in the forward already
    grads = grads_of(mod, call, dout, q, k, v, out, saved)
    return owned(grads, (dout, q, k, v, out, *saved, alibi, sinks))


@attention_bwd.register_fake
def _attention_bwd_fake(dout, q, k, v, out, saved, alibi, sinks, group, spec, positions, kv_positions, bounds,
                        kv_bounds):
    dsinks = q.new_empty(0) if sinks is None else sinks.new_empty(sinks.shape)
    return [q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks]


def _shape_only(x: torch.Tensor) -> torch.Tensor:
    """A stand-in of ``x`` with its shape, dtype and device and one element of storage (stride 0)."""
    return x.new_zeros(()).expand(x.shape)


_OPTIONAL = 6  # alibi, sinks, positions, kv_positions, bounds, kv_bounds


def _setup_fwd(ctx, inputs, output) -> None:
    q, k, v, alibi, sinks, group, spec, positions, kv_positions, bounds, kv_bounds = inputs
    out, *saved = output
    ctx.mark_non_differentiable(*saved)
    ctx.set_materialize_grads(False)  # no zero gradients for the saved outputs (the LSE, or as large as q, k, v)
    if not getattr(strategy_module(OpSpec.decode(spec).strategy), "BACKWARD_READS_INPUTS", True):
        # its backward reads only the shapes and dtypes of q, k, v and out: keep no copy of them alive
        q, k, v, out = (_shape_only(x) for x in (q, k, v, out))
    optional = (alibi, sinks, positions, kv_positions, bounds, kv_bounds)
    ctx.save_for_backward(q, k, v, out, *saved, *[t for t in optional if t is not None])
    ctx.n_saved, ctx.group, ctx.spec = len(saved), group, spec
    ctx.has = tuple(t is not None for t in optional)


def _backward_fwd(ctx, grads):
    if torch.is_grad_enabled():  # create_graph=True: the saved stand-ins (shapes only) carry no graph to refuse on
        raise RuntimeError(DOUBLE_BACKWARD)
    q, k, v, out, *rest = ctx.saved_tensors
    saved, extra = rest[:ctx.n_saved], iter(rest[ctx.n_saved:])
    alibi, sinks, positions, kv_positions, bounds, kv_bounds = (next(extra) if has else None for has in ctx.has)
    dq, dk, dv, dsinks = attention_bwd(grads[0], q, k, v, out, saved, alibi, sinks, ctx.group, ctx.spec, positions,
                                       kv_positions, bounds, kv_bounds)
    return dq, dk, dv, None, dsinks if sinks is not None else None, None, None, None, None, None, None


def _setup_bwd(ctx, inputs, output) -> None:
    pass


def _refuse_double_backward(ctx, *grads):
    raise RuntimeError(DOUBLE_BACKWARD)


attention_fwd.register_autograd(_backward_fwd, setup_context=_setup_fwd)
attention_bwd.register_autograd(_refuse_double_backward, setup_context=_setup_bwd)


def call_op(call: Call, q, k, v) -> list[torch.Tensor]:
    """``[out, *saved]`` of a prepared call through the custom op (the cross-rank check inside)."""
    return torch.ops.burstattn.attention_fwd(q, k, v, call.alibi, call.sinks, *call_arguments(call))


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

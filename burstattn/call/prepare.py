"""The one call path of every strategy: :func:`prepare` builds and checks a :class:`~burstattn.call.Call`
once; :func:`burstattn.ops.run_call` runs it through the one custom op pair (``torch.ops.burstattn.attention_fwd``
/ ``attention_bwd``), or, for a ``mask_mod`` (a Python function cannot be an op argument), through the
one eager fallback :class:`burstattn.ops.EagerCall` over the same functions.

So ``torch.compile(fullgraph=True)`` captures every strategy and selective-checkpoint policies see it
(:data:`burstattn.ops.SAVED_OPS`). The Python before the op only reads shapes and option values; the
cross-rank input check runs inside the op, on every call. A strategy module provides
``check(call, q, k, v) -> call`` (the collective input check, returning the call with its mask plan),
``plan_of(call, q, k)`` (that plan again, pure: for the backward), ``forward(call, q, k, v) -> (out,
saved)``, ``backward(call, dout, q, k, v, out, saved) -> (dq, dk, dv[, dsinks])`` and ``fake(call, q, k, v)
-> [out, *saved]`` (empty tensors of the right shapes).
"""
from __future__ import annotations

from dataclasses import fields
from typing import Optional

import torch

from ..comm.groups import group_context
from ..engine.bytes import choose_backward
from ..kernels import resolve_backend
from ..layouts.named import layout_or_default
from ..masks.plan import choose_mask_backward
from ..masks.setup import build_mask, topology_problem
from .call import Call
from .engine_adapter import kernel_needs
from .options import KEYWORDS, Keywords
from .validate import check_inputs, dropout_problem, local_problem, runs_backward, scale_value, softcap_value

__all__ = ["prepare", "refuse", "resolve_backward"]

ENGINE_STRATEGIES = ("burst", "ring")  # the strategies that take every option of today's models


def label(name: str) -> str:
    """How a strategy names itself in error messages: ``attention(strategy='name')``."""
    return f"attention(strategy={name!r})"


def one_sequence_problem(name: str, q, k, v) -> Optional[tuple[type, str]]:
    """Why a strategy that needs one sequence and one head size cannot take ``q, k, v``, or ``None``."""
    if not all(isinstance(x, torch.Tensor) and x.dim() == 4 for x in (q, k, v)):
        return None  # the shared input check reports it
    if q.shape[1] != k.shape[1] or v.shape[3] != q.shape[3]:
        return ValueError, (f"strategy {name!r} needs queries and keys of one sequence (q.shape[1] == k.shape[1]) "
                            f"and one head size for q, k and v, got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                            f"v {tuple(v.shape)}; cross-attention, unequal lengths and a V head size of its own "
                            f"run on strategy {' or '.join(map(repr, ENGINE_STRATEGIES))}")
    return None


def resolve_backward(cfg: Call, q, k, v, world_size: int) -> str:
    """``cfg.backward`` with ``"auto"`` resolved by shapes (the one that sends fewer bytes) for the ring
    engine: the masked engine's choice for a sparse call, the dense ring's otherwise."""
    if cfg.backward != "auto" or cfg.schedule == "distflash":
        return cfg.backward
    shape = dict(batch=q.shape[0], local_seq=q.shape[1], q_heads=q.shape[2], kv_heads=k.shape[2],
                 head_dim=q.shape[3], dtype=q.dtype, kv_local_seq=k.shape[1], v_head_dim=v.shape[3])
    if cfg.sparse:
        return choose_mask_backward(**shape)
    return choose_backward(world_size=world_size, **shape)


def refuse(fn: str, problem: tuple[type, str], group=None) -> None:
    """Raise ``problem`` on every rank of ``group``: this rank's side of the cross-rank check that the
    other ranks run in their call (so none of them is left waiting)."""
    where = group_context(group)
    check_inputs(None, None, None, None, where.group, where.world_size, fn=fn, problem=problem)
    raise problem[0](f"{fn}: {problem[1]}")  # a world of one raised above; kept for the type checker


CONVERT = {"softmax_scale": scale_value, "softcap": softcap_value, "layout": layout_or_default}
"""The keywords a :class:`Call` holds converted: a real number as a float (for the op's spec), flash-attn's
``softcap=0.0`` as ``None`` (off), ``layout=None`` as the default layout."""
FROM_KEYWORDS = tuple((f.name, f.metadata.get("keyword", f.name)) for f in fields(Call)
                      if f.metadata.get("keyword", f.name) in KEYWORDS)
"""``(Call field, keyword)`` of every field of :class:`Call` that a keyword fills (the same name unless the
field's ``metadata["keyword"]`` says otherwise; ``None`` there: built here, as the mask)."""


def prepare(strategy: str, q, k, v, keywords: Keywords, *, fn: Optional[str] = None, options: Optional[dict] = None,
            problem: Optional[tuple[type, str]] = None) -> Call:
    """The :class:`~burstattn.call.Call` of one call of ``strategy`` with ``keywords``
    (:class:`~burstattn.call.options.Keywords`), built and checked once: every field a keyword fills copied
    from it (:data:`FROM_KEYWORDS`, :data:`CONVERT`), the mask built from its mask keywords; the local check
    runs here once and the backend is resolved here once (the op does not repeat either). ``problem``: what the
    strategy found wrong on this rank (raised on every rank); ``options``: the strategy's own (ints and
    strings); ``fn``: the caller's name in messages. Traceable: only shapes and option values are read (a bad
    input raises on every rank here, through the cross-rank check)."""
    where = group_context(keywords.group)
    amask, mask_problem = build_mask(keywords)
    values = {name: getattr(keywords, keyword) for name, keyword in FROM_KEYWORDS}
    for name, convert in CONVERT.items():
        values[name] = convert(values[name])
    values.update(mask=amask, grad=runs_backward(q, k, v, keywords.sinks), strategy=strategy, fn=fn or label(strategy),
                  where=where, options=tuple(sorted((options or {}).items())))
    call = Call(**values)
    problem = problem or mask_problem or dropout_problem(keywords.dropout_p)
    if strategy not in ENGINE_STRATEGIES:
        problem = problem or one_sequence_problem(strategy, q, k, v)
    problem = problem or local_problem(q, k, v, call, call.alibi, call.sinks)
    if problem is None:
        try:
            values["backend"] = resolve_backend(call.backend, q.device, q.dtype,
                                                kernel_needs(call, q.shape[-1], v.shape[-1]))
        except ValueError as e:
            problem = ValueError, str(e)
    problem = problem or topology_problem(call, where.world_size)
    if problem is not None:  # raises on every rank
        check_inputs(q, k, v, call, where.group, where.world_size, fn=call.fn, problem=problem, alibi=call.alibi,
                     sinks=call.sinks)
    if strategy in ENGINE_STRATEGIES:  # (reads neither the backend nor anything resolved above)
        values["backward"] = resolve_backward(call, q, k, v, where.world_size)
    return Call(**values)  # once more, with the resolved backend and backward (cheaper than two replace())

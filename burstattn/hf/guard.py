"""The checks burstattn's attention and mask functions make on the model that is running them.

transformers calls the registered functions with one attention module (or a mask's sizes), never the
model. Whether the model as a whole can run sequence parallel (:func:`burstattn.hf.families.check_model`)
and what its own forward was given (``labels``) are read from the model whose ``forward`` is on the
call stack: the outermost ``PreTrainedModel`` frame of this thread. The survey is cached on the model
(keyed by its configs' ``_attn_implementation``), so a forward pays a walk over a few frames, not the
survey. Outside a model's forward (a layer called alone, activation checkpointing's recomputation in
the backward) there is no such frame and nothing is checked: the forward already was.
"""
from __future__ import annotations

import sys
from typing import Any, Optional

from .families import SUPPORTED_KEY, model_problem

CACHE_KEY = "_burstattn_check"  # on the model: (signature, problem or None) of its last survey


def calling_model(depth: int = 1) -> Optional[tuple[Any, dict]]:
    """``(model, its forward's locals)`` of the outermost transformers ``PreTrainedModel`` whose
    ``forward`` is running on this thread (above ``depth`` frames), or ``None``."""
    from transformers import PreTrainedModel

    frame, found = sys._getframe(depth + 1), None
    while frame is not None:
        if frame.f_code.co_name == "forward":
            local = frame.f_locals
            if isinstance(local.get("self"), PreTrainedModel):
                found = local["self"], local
        frame = frame.f_back
    return found


def _signature(model) -> tuple:
    cfg = getattr(model, "config", None)
    subs = [getattr(cfg, k, None) for k in sorted(getattr(cfg, "sub_configs", {}) or {})]
    return tuple(getattr(c, "_attn_implementation", None) for c in [cfg] + subs)


def running_model_problem(model) -> Optional[str]:
    """:func:`~burstattn.hf.families.model_problem` of ``model`` (router logits aside: the attention
    function refuses those per forward), cached on the model until its attention implementation changes."""
    sig = _signature(model)
    cached = model.__dict__.get(CACHE_KEY)
    if cached is None or cached[0] != sig:
        problem = model_problem(model, model.__dict__.get(SUPPORTED_KEY, ()), router=False)
        cached = (sig, problem)
        model.__dict__[CACHE_KEY] = cached
    return cached[1]


def check_running_model(depth: int = 1) -> Optional[dict]:
    """Raise ``ValueError`` (check_model's message) if the model running this forward cannot run under
    burstattn; returns the locals of its ``forward`` (``None`` outside a model's forward)."""
    hit = calling_model(depth + 1)
    if hit is None:
        return None
    problem = running_model_problem(hit[0])
    if problem:
        raise ValueError(problem)
    return hit[1]

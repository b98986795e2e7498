"""The leaner rematerialization: keep a layer's input and its attention op's outputs, nothing else.

DistFlashAttn's rematerialization-aware checkpointing, the way selective activation
checkpointing does it: the segment "norm -> q/k/v projections -> rotary -> distributed
attention" runs under ``torch.utils.checkpoint`` with a ``context_fn`` of two dispatch modes.
In the forward, :class:`_KeepOutputs` records the outputs of the attention op
(``torch.ops.burstattn.attention_fwd``: the output ``[B, n, Hq, D]`` and the LSE ``[B, Hq, n]``)
and lets everything else be dropped; in the backward's recomputation, :class:`_ReplayOutputs`
reruns the norm, the projections and rotary, and answers the attention op from the record, so
the distributed attention forward (and its communication) never reruns. What the layer keeps
between forward and backward is therefore its input, the attention output and the LSE: q, k and
v are rebuilt from the input (cheap projections) when the attention's backward needs them.

This is :func:`burstattn.ops.remat_policy`'s ``MUST_SAVE`` rule, with one addition torch's own
selective checkpointing does not offer: the kept outputs go through a ``keep`` function, which
:class:`~burstattn.models.offload.HostOffload` uses to move them to host memory.

Only an attention that runs as the registered op can be kept this way; :mod:`.llama` runs other
strategies (their collectives are not ops a record can answer) outside the checkpoint instead.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from ..ops import SAVED_OPS


class _KeepOutputs(TorchDispatchMode):
    """Forward: run every op; record ``keep(output)`` of the saved ops, in call order."""

    def __init__(self, record: list, keep: Callable) -> None:
        super().__init__()
        self.record, self.keep = record, keep

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in SAVED_OPS:
            self.record.append(tree_map(lambda t: self.keep(t.detach()) if isinstance(t, torch.Tensor) else t, out))
        return out


class _ReplayOutputs(TorchDispatchMode):
    """Recomputation: answer the saved ops from the record (in call order), run the others."""

    def __init__(self, record: list, restore: Callable) -> None:
        super().__init__()
        self.record, self.restore, self.at = record, restore, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in SAVED_OPS:
            return func(*args, **(kwargs or {}))
        if self.at >= len(self.record):
            raise RuntimeError("remat: the recomputation called the attention op more often than the forward did "
                               "(a second backward through the same graph is not supported)")
        kept = self.record[self.at]
        self.at += 1
        return tree_map(lambda t: self.restore(t), kept)


def keep_attention_context(keep: Callable = lambda t: t, restore: Callable = lambda t: t) -> Callable:
    """The ``context_fn`` of one checkpointed segment (a fresh record per call): the attention
    op's outputs are kept through ``keep`` and given back through ``restore``."""

    def context_fn():
        record: list = []
        return _KeepOutputs(record, keep), _ReplayOutputs(record, restore)

    return context_fn


"""Activation checkpointing modes of a transformer block: ``none``, ``full`` and ``remat``.

* ``none``: every activation is kept.
* ``full``: ordinary per-layer checkpointing. Only the block's input is kept; the backward reruns
  the whole block, the distributed attention forward included (two attention forwards per layer
  per step).
* ``remat``: DistFlashAttn's rematerialization-aware checkpointing. The checkpoint boundary is the
  attention output: the attention's own saved tensors (its inputs, output and log-sum-exp) are
  kept, the rest of the layer (norms, q/k/v projections + rotary, the MLP) is recomputed in the
  backward, and the distributed attention forward never reruns (one attention forward per layer).

:func:`segment_runner` is the one place that decides how ``remat`` is realised. Today it
checkpoints the segments before and after the attention call separately (the attention runs
outside any checkpoint, so autograd keeps what it saved). A registered attention op with a
``MUST_SAVE`` selective-checkpoint policy is the drop-in alternative: checkpoint the whole block
under that policy instead.
"""
from __future__ import annotations

from typing import Callable

from torch.utils.checkpoint import checkpoint

CHECKPOINTING = ("none", "full", "remat")


def direct(fn: Callable, *args):
    """Run ``fn(*args)`` and keep its activations."""
    return fn(*args)


def checkpointed(fn: Callable, *args):
    """Run ``fn(*args)`` keeping only its inputs; recomputed in the backward (non-reentrant)."""
    return checkpoint(fn, *args, use_reentrant=False)


def check_checkpointing(mode: str) -> None:
    """Raise ``ValueError`` unless ``mode`` is one of :data:`CHECKPOINTING`."""
    if mode not in CHECKPOINTING:
        raise ValueError(f"checkpointing must be one of {CHECKPOINTING}, got {mode!r}")


def segment_runner(mode: str) -> tuple[Callable, Callable]:
    """``(whole_layer, segment)`` runners for ``mode``: the block calls
    ``whole_layer(layer_fn, x, ..., segment)`` and, inside, ``segment(fn, *args)`` around each piece
    that is not the attention call."""
    check_checkpointing(mode)
    if mode == "full":
        return checkpointed, direct
    if mode == "remat":
        return direct, checkpointed
    return direct, direct

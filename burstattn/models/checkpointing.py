"""How a transformer block runs: checkpointing mode, MLP chunk, offload (:class:`LayerRun`).

Checkpointing modes:

* ``none``: every activation is kept.
* ``full``: ordinary per-layer checkpointing. Only the block's input is kept; the backward reruns
  the whole block, the distributed attention forward included (two attention forwards per layer
  per step).
* ``remat``: DistFlashAttn's rematerialization-aware checkpointing, lean: the block keeps its
  input, the attention output and the LSE. The backward recomputes the norms, the q/k/v
  projections, rotary, the output projection and the MLP, and the distributed attention forward
  never reruns (one attention forward per layer per step). For an attention that runs as the
  registered op (``burst``, ``ring``: :attr:`AttnCall.through_op`) the segment up to and including
  the attention is checkpointed and the op's outputs are kept (:mod:`.remat`), so q, k and v are
  rebuilt from the input. Other strategies (their collectives are not ops a checkpoint can
  answer) run outside the checkpoint: they keep what their own backward saves (for ``ulysses``
  its head-sharded q, k, v; for ``allgather`` the gathered K/V), the norm and the projections
  are still recomputed.

The MLP with its norm and residual (and the output projection ``wo`` before it) runs over
chunks of ``mlp_chunk`` local tokens (:func:`.blockwise.blockwise_rows`), each recomputed in the
backward; with ``remat`` it is recomputed whatever the chunk.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from .blockwise import recomputed
from .offload import HostOffload
from .remat import keep_attention_context

CHECKPOINTING = ("none", "full", "remat")


def check_checkpointing(mode: str) -> None:
    """Raise ``ValueError`` unless ``mode`` is one of :data:`CHECKPOINTING`."""
    if mode not in CHECKPOINTING:
        raise ValueError(f"checkpointing must be one of {CHECKPOINTING}, got {mode!r}")


@dataclass(frozen=True)
class LayerRun:
    """How one forward runs its blocks."""

    checkpointing: str = "none"
    """``none``, ``full`` or ``remat`` (see the module docstring)."""
    mlp_chunk: int = 0
    """Tokens per chunk of the blockwise MLP (0: the whole local sequence)."""
    through_op: bool = False
    """The attention runs as ``torch.ops.burstattn.attention_fwd`` (``remat`` can keep its outputs)."""
    offload: Optional[HostOffload] = None
    """Where saved tensors go (``None``: they stay)."""

    def __post_init__(self) -> None:
        check_checkpointing(self.checkpointing)

    @property
    def mlp_recomputed(self) -> bool:
        """Whether the MLP chunks run under checkpoints (chunked, or ``remat``)."""
        return self.mlp_chunk > 0 or self.checkpointing == "remat"

    def attention_segment(self, fn: Callable, *args):
        """Run ``fn(*args)`` (the segment norm -> projections -> rotary -> attention) as ``remat``
        with an op attention needs: checkpointed, the attention op's outputs kept (offloaded with
        ``offload="all"``)."""
        off = self.offload
        if off is not None and off.mode == "all":
            ctx = keep_attention_context(off.pack, off.unpack)
        else:
            ctx = keep_attention_context()
        return recomputed(fn, *args, context_fn=ctx)

    def whole_layer(self, fn: Callable, *args):
        """``full``: the whole block under one checkpoint; otherwise ``fn(*args)``."""
        if self.checkpointing == "full":
            return recomputed(fn, *args)
        return fn(*args)


def checkpointed(fn: Callable, *args):
    """Run ``fn(*args)`` keeping only its inputs; recomputed in the backward (:func:`.blockwise.recomputed`)."""
    return recomputed(fn, *args)

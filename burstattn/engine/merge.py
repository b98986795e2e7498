"""The one log-sum-exp merge used by every strategy (BurstAttention's global optimisation), and the
attention sinks that join it once, at the end."""
from __future__ import annotations

import torch


def merge_(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
           block_lse: torch.Tensor) -> None:
    """Fold a partial result into the running one, in place, in the accumulators' dtype
    (float32; float64 for float64 inputs).

    Args:
        out: running output ``[B, H, S, D]``, normalised over the keys seen so far.
        lse: running log-sum-exp ``[B, H, S]``; ``-inf`` for rows that saw no key.
        block_out: partial output over one block of keys ``[B, H, S, D]`` (any float dtype,
            finite; rows that saw no key must hold zeros).
        block_lse: its log-sum-exp ``[B, H, S]``; ``-inf`` rows contribute nothing.

    Uses the stable form ``out -= sigmoid(block_lse - lse) * (out - block_out)`` and
    ``lse = logaddexp(lse, block_lse)``; rows that are ``-inf`` on both sides stay
    ``(out, -inf)`` without NaN.
    """
    block_lse = block_lse.to(lse.dtype)
    w = torch.sigmoid(block_lse - lse).nan_to_num_(0.0)  # both -inf: nan -> keep running value
    out.sub_(w.unsqueeze(-1) * (out - block_out.to(out.dtype)))
    lse.copy_(torch.logaddexp(lse, block_lse))  # not `out=`: fake tensors decompose out= ops in Python (20x slower)


def add_sinks_(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> None:
    """Fold attention sinks into a FINISHED merge, in place (once: after every block is merged).

    A sink is a logit per head that joins every row's softmax denominator and carries no value
    (gpt-oss): ``lse' = logaddexp(lse, sink_h)`` and ``out *= exp(lse - lse')``. ``out [B, H, S, D]``,
    ``lse [B, H, S]`` (accumulator dtype), ``sinks [H]``. A row that saw no key keeps output 0 and
    gets ``lse' = sink_h``.
    """
    s = sinks.to(lse.dtype).view(1, -1, 1).expand_as(lse)
    new = torch.logaddexp(lse, s)
    out.mul_(torch.exp(lse - new).unsqueeze(-1))
    lse.copy_(new)


def sinks_grad(lse: torch.Tensor, delta: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The gradient of the sink logits: ``-sum_{b,i} exp(sink_h - lse_{b,h,i}) * D_{b,h,i}`` (the sink's
    softmax weight times its value, 0, minus the row's ``D = rowsum(dO * O)``). ``lse`` (sinks
    included) and ``delta`` ``[B, H, S]``; returns ``[H]`` in the accumulator dtype."""
    return -(torch.exp(sinks.to(lse.dtype).view(1, -1, 1) - lse) * delta.to(lse.dtype)).sum((0, 2))

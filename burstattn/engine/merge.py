"""The one log-sum-exp merge used by every strategy (BurstAttention's global optimisation)."""
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
    torch.logaddexp(lse, block_lse, out=lse)

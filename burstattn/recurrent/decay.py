"""Decay factors inside a chunk, computed without the cancellation of cumulative-sum differences.

A chunk of ``C`` tokens with log decays ``g_1 .. g_C`` (<= 0) needs, for every pair ``j <= i``, the
decay from token ``j`` to token ``i``: ``exp(g_{j+1} + ... + g_i)``. Forming it as ``G_i - G_j`` with
``G`` the cumulative sum loses the small difference of two large numbers: over a 64-token chunk of
Mamba2's ``dt * A`` (``|G|`` reaching tens), float32 keeps only ``|G| * 6e-8`` of absolute precision
in every pair, and the error reaches the gradient of ``A_log`` (a near-cancelling sum over tokens)
10-30x above transformers' own float32 error. Mamba2's ``segsum`` (and transformers'
``segment_sum``) masks first and then sums the *differences* themselves, so every pair's exponent is
a sum of its own terms only: the same precision whatever the chunk's total decay.
"""
from __future__ import annotations

import torch


def segsum(g: torch.Tensor) -> torch.Tensor:
    """Segment sums of the last dim: ``g [..., C]`` -> ``[..., C, C]``.

    ``out[..., i, j] = g_{j+1} + ... + g_i`` for ``j <= i`` (0 on the diagonal), ``-inf`` above it
    (``exp`` of it is the causal decay mask). Each entry is a cumulative sum of its own terms
    (mask, then ``cumsum``), never a difference of two prefix sums.
    """
    C = g.shape[-1]
    strict = torch.ones(C, C, dtype=torch.bool, device=g.device).tril(-1)
    x = g.unsqueeze(-1).expand(*g.shape, C).masked_fill(~strict, 0.0)  # x[..., i, j] = g_i for i > j
    out = x.cumsum(dim=-2)  # [..., C, C]: sum over j < t <= i
    return out.masked_fill(~strict.logical_or(torch.eye(C, dtype=torch.bool, device=g.device)), float("-inf"))


def chunk_decays(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The decays a chunked recurrence needs, for chunks of log decays along dim ``-2``.

    Args:
        g: ``[..., C, c]``: per chunk, ``C`` tokens' log decays, ``c`` = 1 (a scalar decay per token
            and head) or ``dk`` (a decay per channel, KDA).
    Returns:
        ``(G, pair, to_end)``:

        * ``G [..., C, c]``: the log decay from the chunk's start through token ``i`` (a prefix sum:
          no difference involved);
        * ``pair [..., C, C]`` (``c`` = 1) or ``[..., C, C, c]``: ``exp`` of the decay from token ``j``
          to token ``i`` for ``j <= i``, 0 above the diagonal;
        * ``to_end [..., C, c]``: the log decay from token ``j`` to the chunk's last token (the
          segment sums' last row).
    """
    G = g.cumsum(dim=-2)
    seg = segsum(g.transpose(-1, -2))  # [..., c, C, C]
    to_end = seg[..., -1, :].transpose(-1, -2)  # [..., C, c]
    pair = seg.squeeze(-3).exp() if g.shape[-1] == 1 else seg.movedim(-3, -1).exp()
    return G, pair, to_end

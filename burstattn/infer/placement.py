"""Where new tokens' K/V go in a sharded cache: the balanced placement policy.

Policy (one rule for prefill leftovers, continuation prompts and decoded tokens): the ``m`` new
tokens, in order, are dealt out in contiguous chunks, rank 0's chunk first; the chunk sizes are
chosen by water-filling, i.e. each new token goes to the rank whose shard is then the shortest
(the lowest rank on ties). Shard lengths therefore never differ by more than they did before the
append, or by one, whichever is larger. A decoded token (``m = 1``) goes to the shortest shard.

Pure functions of the per-rank shard lengths, which every rank tracks identically, so every rank
knows where every token lives without communicating.
"""
from __future__ import annotations

import torch


def placement_counts(lengths: list[int], m: int) -> list[int]:
    """How many of ``m`` new tokens each rank takes, given the current shard ``lengths``
    (one per rank). Water-filling: the result minimises the longest shard, lower ranks first."""
    if m < 0:
        raise ValueError(f"the number of new tokens must be >= 0, got {m}")
    counts = [0] * len(lengths)
    now = list(lengths)
    for _ in range(m):
        r = min(range(len(now)), key=lambda i: (now[i], i))
        counts[r] += 1
        now[r] += 1
    return counts


def placement_positions(lengths: list[int], start: int, m: int) -> list[torch.Tensor]:
    """The global positions (LongTensor ``[counts[r]]``) each rank stores for the new tokens at
    positions ``start .. start + m - 1``: contiguous chunks in rank order."""
    counts = placement_counts(lengths, m)
    out, at = [], start
    for c in counts:
        out.append(torch.arange(at, at + c, dtype=torch.long))
        at += c
    return out

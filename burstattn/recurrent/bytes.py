"""Bytes each rank sends for the sequence-parallel recurrences, by formula (pure functions).

They match what :func:`burstattn.comm_stats` meters under ``"state"``/``"dstate"`` and
``"halo"``/``"dhalo"`` (the input check's few bytes are metered apart, under ``"meta"``). Neither
depends on the sequence length, only on how many segments / halo rows the layout makes.
"""
from __future__ import annotations

from .segments import halo_plan, segment_plan


def state_passing_bytes(seq_len: int, world_size: int, layout, *, batch: int, heads: int, dk: int, dv: int,
                        matrix: bool, element_size: int = 4, cu_seqlens=None) -> dict:
    """``{"forward": sent bytes, "backward": sent bytes}`` of one call on any rank.

    The all-gather sends ``(P - 1)`` copies of this rank's summaries: ``S_max`` slots (the most
    segments a rank holds: 1 contiguous, 2 zigzag) of ``batch * heads * (a + dk * dv)`` elements,
    ``a = dk * dk`` for a matrix transition (delta rule), 1 for a scalar decay. The backward's
    reduce-scatter sends the same amount.
    """
    slots = segment_plan(seq_len, world_size, layout, cu_seqlens).max_segments
    per = (world_size - 1) * slots * batch * heads * ((dk * dk if matrix else 1) + dk * dv) * element_size
    return {"forward": per, "backward": per}


def conv_halo_bytes(seq_len: int, world_size: int, layout, *, batch: int, channels: int, width: int = 4,
                    element_size: int = 4, cu_seqlens=None) -> dict:
    """``{"forward", "backward"}`` bytes of one :func:`~burstattn.recurrent.sp_causal_conv1d` call:
    ``(P - 1) * rows * batch * channels`` elements each way, ``rows`` the most halo rows a rank sends
    (``K - 1`` contiguous, ``2 (K - 1)`` zigzag)."""
    rows = halo_plan(seq_len, world_size, 0, layout, width, cu_seqlens).count
    per = (world_size - 1) * rows * batch * channels * element_size
    return {"forward": per, "backward": per}

"""Bytes and rounds each rank sends for the sequence-parallel recurrences, by formula (pure functions).

They match what :func:`burstattn.comm_stats` meters under ``"state"``/``"dstate"`` and
``"halo"``/``"dhalo"`` (the input check's few bytes are metered apart, under ``"meta"``): bytes,
and the number of metered records (``msgs``: one per collective or per point-to-point round a
rank takes part in). Neither depends on the sequence length, nor on the number of packed
documents beyond the segments that touch a rank boundary.
"""
from __future__ import annotations

from typing import Optional

from .scan import scan_plan, scan_traffic
from .schemes import resolve_scheme
from .segments import halo_plan, segment_plan


def _state_traffic(seq_len: int, world_size: int, layout, *, batch: int, heads: int, dk: int, dv: int,
                   matrix: bool, element_size: int, cu_seqlens, output_final_state: bool, scheme: str,
                   initial_state_grad: bool) -> list:
    """Per rank, ``{phase: (bytes sent, records)}`` of one call (forward and backward)."""
    P = world_size
    if P == 1:
        return [{"forward": (0, 0), "backward": (0, 0)}]
    full = batch * heads * ((dk * dk if matrix else 1) + dk * dv) * element_size  # one map [A | B]
    state = batch * heads * dk * dv * element_size  # one state B
    seg = segment_plan(seq_len, P, layout, cu_seqlens)
    out = []
    if resolve_scheme(scheme, P) == "allgather":
        slots = seg.max_sent(output_final_state)
        out = [{"forward": [(P - 1) * slots * full, 1], "backward": [(P - 1) * slots * full, 1]} if slots
               else {"forward": [0, 0], "backward": [0, 0]} for _ in range(P)]
    else:
        plan = scan_plan(seg, output_final_state)
        for rank, steps in enumerate(scan_traffic(plan, P)):
            fwd, bwd = [0, 0], [0, 0]
            for (fs, ss), (fr, sr) in steps:
                fwd = [fwd[0] + fs * full + ss * state, fwd[1] + 1]
                bwd = [bwd[0] + fr * full + sr * state, bwd[1] + 1]  # each received value's gradient goes back
            if output_final_state:  # the final state's broadcast (its root puts it on the wire once)
                fwd = [fwd[0] + (state if rank == plan.owner[plan.final_run] else 0), fwd[1] + 1]
            out.append({"forward": fwd, "backward": bwd})
    for t in out:
        if initial_state_grad:  # the initial state's gradient, all-reduced (ring: 2 (P - 1) / P of it)
            t["backward"] = [t["backward"][0] + state * 2 * (P - 1) // P, t["backward"][1] + 1]
    return [{k: tuple(v) for k, v in t.items()} for t in out]


def state_passing_bytes(seq_len: int, world_size: int, layout, *, batch: int, heads: int, dk: int, dv: int,
                        matrix: bool, element_size: int = 4, cu_seqlens=None, output_final_state: bool = False,
                        scheme: str = "auto", initial_state_grad: bool = False,
                        rank: Optional[int] = None) -> dict:
    """``{"forward": sent bytes, "backward": sent bytes}`` of one call on ``rank`` (``None``: the most
    any rank sends, per direction).

    ``"allgather"``: ``(P - 1) x slots`` maps of ``batch * heads * (a + dk * dv)`` elements each way,
    ``a = dk * dk`` for a matrix transition (delta rule), 1 for a scalar decay; ``slots`` the most
    summaries a rank's segments send (:meth:`~.segments.SegmentPlan.sent`: those whose document
    continues on another rank; zigzag: 2, contiguous: 1, whatever the number of packed documents;
    0 when every document stays on its rank). The backward's reduce-scatter sends the same.
    ``"scan"``: per round a rank sends its values some later run reads (a map, or a state alone
    once it starts from a document start), then the shift's states; the backward returns each
    received value's gradient. ``output_final_state`` adds the final state's broadcast (scan),
    ``initial_state_grad`` the initial state's gradient all-reduce (both).
    """
    per = _state_traffic(seq_len, world_size, layout, batch=batch, heads=heads, dk=dk, dv=dv, matrix=matrix,
                         element_size=element_size, cu_seqlens=cu_seqlens, output_final_state=output_final_state,
                         scheme=scheme, initial_state_grad=initial_state_grad)
    per = per if rank is None else [per[rank]]
    return {phase: max(t[phase][0] for t in per) for phase in ("forward", "backward")}


def state_passing_steps(seq_len: int, world_size: int, layout, *, rank: Optional[int] = None,
                        cu_seqlens=None, output_final_state: bool = False, scheme: str = "auto",
                        initial_state_grad: bool = False) -> dict:
    """``{"forward": records, "backward": records}``: the collectives or point-to-point rounds
    ``rank`` takes part in (``comm_stats()``'s ``msgs`` under ``state``/``dstate``; ``None``: the
    most of any rank). ``"allgather"``: 1 each way (0 when nothing travels); ``"scan"``: at most
    ``ceil(log2 E) + 1`` (``E`` runs, ``2P - 1`` under zigzag), fewer with packed documents."""
    per = _state_traffic(seq_len, world_size, layout, batch=1, heads=1, dk=1, dv=1, matrix=True, element_size=1,
                         cu_seqlens=cu_seqlens, output_final_state=output_final_state, scheme=scheme,
                         initial_state_grad=initial_state_grad)
    per = per if rank is None else [per[rank]]
    return {phase: max(t[phase][1] for t in per) for phase in ("forward", "backward")}


def conv_halo_bytes(seq_len: int, world_size: int, layout, *, batch: int, channels: int, width: int = 4,
                    element_size: int = 4, cu_seqlens=None) -> dict:
    """``{"forward", "backward"}`` bytes of one :func:`~burstattn.recurrent.sp_causal_conv1d` call:
    ``(P - 1) * rows * batch * channels`` elements each way, ``rows`` the most halo rows a rank sends
    (``K - 1`` contiguous, ``2 (K - 1)`` zigzag)."""
    rows = halo_plan(seq_len, world_size, 0, layout, width, cu_seqlens).count
    per = (world_size - 1) * rows * batch * channels * element_size
    return {"forward": per, "backward": per}

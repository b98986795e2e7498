"""Packed documents and padding of a transformers batch, as burstattn's document mask (pure functions).

A batch ``input_ids [B, N]`` can carry three kinds of structure:

* packing (``DataCollatorWithFlattening``): ``position_ids`` that restart (a new document wherever a
  position is not the previous one plus one), or flash-attn's ``cu_seq_lens_q`` / ``cu_seq_lens_k``;
* padding: a 2-D ``attention_mask`` whose zeros are a prefix (left padding) and/or a suffix (right
  padding) of each row;
* neither: every token of a row attends causally to the whole row.

Without structure the rows stay rows (:attr:`BatchPlan.flattened` is False). With any, the rows are laid
end to end into ONE global sequence of ``T >= B*N`` tokens whose documents are the rows, the packed
documents inside them and every run of pads (pads attend only to pads, so no real token ever sees a pad
and a pad query row is finite). That is exactly the ``cu_seqlens`` document mask of
:class:`burstattn.AttnMask`, per batch row, built from what the engine already has: no per-row key mask
is needed. Zeros between real tokens (a hole) would need a key mask the document mask cannot express
and are refused.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from ..config import IGNORE_INDEX


@dataclass(frozen=True)
class BatchPlan:
    """How a batch ``[B, N]`` becomes the global sequence that is sharded.

    Attributes:
        batch, length: the caller's ``B`` and ``N``.
        flattened: rows laid end to end into one row (any packing or padding), else rows kept.
        row_len: length of one (padded) row of the sharded global batch: ``T`` when flattened,
            the row length rounded up to the layout's unit otherwise.
        starts: document starts over the flattened sequence (int64 ``[D]``, first 0), or ``None``.
        pads: bool ``[B, N]``, True where ``attention_mask`` is 0 (``None``: no padding).
    """

    batch: int
    length: int
    flattened: bool
    row_len: int
    starts: Optional[torch.Tensor]
    pads: Optional[torch.Tensor]

    def padded(self, unit: int) -> "BatchPlan":
        """This plan with ``row_len`` rounded up to a multiple of ``unit`` (the layout's split)."""
        used = self.batch * self.length if self.flattened else self.length
        return replace(self, row_len=-(-used // unit) * unit)

    @property
    def rows(self) -> int:
        """Rows of the sharded batch: 1 when flattened, else ``batch``."""
        return 1 if self.flattened else self.batch

    def cu_seqlens(self) -> Optional[torch.Tensor]:
        """Document boundaries ``[0, ..., row_len]`` over the flattened sequence (the tail pad, if
        any, is a document of its own), or ``None`` for unflattened rows."""
        if self.starts is None:
            return None
        used = self.batch * self.length
        tail = [used] if self.row_len > used else []
        return torch.cat([self.starts, torch.tensor(tail + [self.row_len], dtype=torch.int64)])


def _starts_of_row(pos: Optional[torch.Tensor], pads: Optional[torch.Tensor], n: int) -> tuple[list[int], Optional[str]]:
    """Document starts inside one row ``[N]``: pad runs, and restarts of ``pos`` inside the real run."""
    starts = {0}
    if pads is not None and bool(pads.any()):
        real = torch.nonzero(~pads).flatten()
        if real.numel() == 0:
            return [0], None  # a row of pads only: one (pad) document
        lo, hi = int(real[0]), int(real[-1]) + 1
        if hi - lo != real.numel():
            return [], ("attention_mask has zeros between real tokens; only left and/or right padding "
                        "(zeros at the ends of a row) can be honoured")
        starts.update(x for x in (lo, hi) if x < n)
    else:
        lo, hi = 0, n
    if pos is not None and hi - lo > 1:
        seg = pos[lo:hi]
        restarts = torch.nonzero(seg[1:] != seg[:-1] + 1).flatten() + 1 + lo
        starts.update(int(i) for i in restarts)
    return sorted(starts), None


def _cu_problem(cu_q, cu_k, b: int, n: int) -> tuple[Optional[torch.Tensor], Optional[str]]:
    if cu_k is not None and cu_q is None:
        cu_q, cu_k = cu_k, None
    if cu_q is None:
        return None, None
    cu = torch.as_tensor(cu_q).to("cpu", torch.int64).flatten()
    if cu_k is not None and not torch.equal(cu, torch.as_tensor(cu_k).to("cpu", torch.int64).flatten()):
        return None, "cu_seq_lens_q and cu_seq_lens_k differ; self-attention needs the same documents for both"
    if b != 1:
        return None, f"cu_seq_lens_q describes documents of ONE packed row, but input_ids has {b} rows"
    if cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != n or bool((cu[1:] <= cu[:-1]).any()):
        return None, f"cu_seq_lens_q must increase strictly from 0 to the row length {n}, got {cu.tolist()[:12]}"
    return cu, None


def plan_batch(input_ids: torch.Tensor, *, attention_mask=None, position_ids=None, cu_seq_lens_q=None,
               cu_seq_lens_k=None) -> tuple[Optional[BatchPlan], Optional[str]]:
    """The :class:`BatchPlan` of ``input_ids [B, N]`` (shapes already checked), or ``(None, problem)``;
    unpadded (``row_len`` the length itself: see :meth:`BatchPlan.padded`)."""
    b, n = input_ids.shape
    pads = None
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
            shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask)
            return None, (f"attention_mask must be a 2-D padding mask [batch, seq] (1 = token, 0 = pad), got "
                          f"{shape}; 4-D and custom masks are not supported (packed documents: pass position_ids "
                          "or cu_seq_lens_q)")
        if tuple(attention_mask.shape) != (b, n):
            return None, f"attention_mask {tuple(attention_mask.shape)} must match input_ids {(b, n)}"
        pads = attention_mask.to("cpu") == 0
        if not bool(pads.any()):
            pads = None
    if position_ids is not None:
        position_ids = position_ids.to("cpu").expand(b, n)
    cu, problem = _cu_problem(cu_seq_lens_q, cu_seq_lens_k, b, n)
    if problem:
        return None, problem
    rows, structured = [], pads is not None or cu is not None
    for r in range(b):
        if cu is not None:
            starts = cu[:-1].tolist()
            if pads is not None:
                extra, problem = _starts_of_row(None, pads[r], n)
                starts = sorted(set(starts) | set(extra))
        else:
            starts, problem = _starts_of_row(None if position_ids is None else position_ids[r],
                                             None if pads is None else pads[r], n)
        if problem:
            return None, f"row {r}: {problem}"
        structured = structured or len(starts) > 1
        rows.append(torch.tensor(starts, dtype=torch.int64) + r * n)
    if not structured:
        return BatchPlan(b, n, False, n, None, None), None
    return BatchPlan(b, n, True, b * n, torch.cat(rows), pads), None


def flatten_rows(x: torch.Tensor, plan: BatchPlan, fill: int) -> torch.Tensor:
    """``x [B, N]`` as the sharded global batch ``[rows, row_len]`` (padded with ``fill``)."""
    if plan.flattened:
        x = x.reshape(1, -1)
    pad = plan.row_len - x.shape[1]
    return torch.cat([x, x.new_full((x.shape[0], pad), fill)], dim=1) if pad else x


def shifted_labels(labels: torch.Tensor, plan: BatchPlan) -> torch.Tensor:
    """Next-token targets of every row ``[B, N]`` (the row's last token: -100), with pad query
    positions -100 too (a pad gives no loss), as the global batch ``[rows, row_len]``."""
    b = labels.shape[0]
    shifted = torch.cat([labels[:, 1:], labels.new_full((b, 1), IGNORE_INDEX)], dim=1)
    if plan.pads is not None:
        shifted = shifted.masked_fill(plan.pads.to(shifted.device), IGNORE_INDEX)
    return flatten_rows(shifted, plan, IGNORE_INDEX)


def rope_positions(position_ids: Optional[torch.Tensor], plan: BatchPlan) -> torch.Tensor:
    """Rotary positions of the global batch ``[rows, row_len]``: the caller's ``position_ids`` (or
    ``arange(N)`` per row, transformers' default), continued past the end for the layout's padding."""
    b, n = plan.batch, plan.length
    pos = torch.arange(n).expand(b, n) if position_ids is None else position_ids.to("cpu").expand(b, n)
    flat = pos.reshape(1, -1) if plan.flattened else pos
    pad = plan.row_len - flat.shape[1]
    if not pad:
        return flat
    tail = flat[:, -1:] + 1 + torch.arange(pad)
    return torch.cat([flat, tail], dim=1)

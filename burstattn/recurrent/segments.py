"""Pure planning for sequence-parallel recurrences: segments and convolution halos.

A *segment* is a maximal run of consecutive global positions held by one rank that does not
cross a document start. Under ``contiguous`` a rank holds one segment, under ``zigzag`` two,
under ``striped`` one per token, under a partition its runs; packed documents (``cu_seqlens``)
cut segments further at every document start. The recurrence's state flows from each segment
to the next in position order, except into a segment that starts a document (a *reset*).

Everything here is a function of ``(seq_len, world_size, layout, cu_seqlens)``: every rank
computes the same plan without communication. The plans are host bookkeeping: they are built on real
tensors even inside the dry run's ``FakeTensorMode`` (:func:`burstattn.config.host_side`), where a
fake tensor could not be read.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..comm.host import host_side
from ..layouts.partition import _check_cu_seqlens, layout_positions


@dataclass(frozen=True)
class SegmentPlan:
    """Segments of every rank.

    Attributes:
        offsets: per rank, the local index where each of its segments starts (LongTensor).
        lengths: per rank, each segment's length.
        starts: per rank, each segment's global start position.
        resets: per rank, whether each segment starts a document (its state starts from zero).
        order: every segment as ``(rank, slot)``, in global position order.
        max_segments: the most segments any rank holds.
        last_owner: the rank holding position ``N - 1`` (it owns the final state).
        run_last: per rank, whether each segment ends a *run* (a maximal stretch of consecutive
            positions on the rank): the position after it, if any, lives on another rank.
        continues: per rank, whether each segment ends a run and its document goes on after it
            (on another rank): only such segments' summaries are ever read by another rank.
    """

    offsets: tuple
    lengths: tuple
    starts: tuple
    resets: tuple
    order: tuple
    max_segments: int
    last_owner: int
    run_last: tuple = ()
    continues: tuple = ()

    def sent(self, rank: int, final: bool = False) -> list:
        """Slots of ``rank`` whose summaries another rank reads: those whose document continues on
        another rank, and with ``final`` the one ending at ``N - 1`` (every rank returns the final
        state). Under ``zigzag`` at most two per rank, whatever the number of documents."""
        keep = self.continues[rank].clone()
        if final and rank == self.last_owner:
            keep[-1] = True  # positions increase on a rank: its last segment ends at N - 1
        return torch.nonzero(keep).flatten().tolist()

    def max_sent(self, final: bool = False) -> int:
        """The most slots any rank sends (the all-gather's slot count; 0: nothing travels)."""
        return max(len(self.sent(r, final)) for r in range(len(self.offsets)))


def doc_starts(seq_len: int, cu_seqlens=None) -> torch.Tensor:
    """Bool ``[N]``: True at every document's first token (position 0 always)."""
    starts = torch.zeros(seq_len, dtype=torch.bool)
    starts[0] = True
    if cu_seqlens is not None:
        cu = _check_cu_seqlens(cu_seqlens, seq_len)
        starts[cu[:-1]] = True
    return starts


def segment_plan(seq_len: int, world_size: int, layout, cu_seqlens=None) -> SegmentPlan:
    """The :class:`SegmentPlan` of a layout (name or Partition) and optional packed documents."""
    with host_side():
        return _segment_plan(seq_len, world_size, layout, cu_seqlens)


def _segment_plan(seq_len: int, world_size: int, layout, cu_seqlens) -> SegmentPlan:
    positions = layout_positions(layout, seq_len, world_size)
    is_start = doc_starts(seq_len, cu_seqlens)
    after = torch.cat([is_start[1:], torch.tensor([True])])  # [N]: a document starts after p (or p = N - 1)
    offsets, lengths, starts, resets, keyed, run_last, continues = [], [], [], [], [], [], []
    last_owner = 0
    for r, pos in enumerate(positions):
        pos = pos.long()
        jump = torch.ones(pos.numel(), dtype=torch.bool)  # jump[j]: local j starts a run
        jump[1:] = pos[1:] - pos[:-1] != 1
        cut = jump.clone()
        cut[1:] |= is_start[pos[1:]]
        off = torch.nonzero(cut).flatten()
        lengths.append(torch.diff(off, append=torch.tensor([pos.numel()])))
        offsets.append(off)
        starts.append(pos[off])
        resets.append(is_start[pos[off]])
        end = off + lengths[-1] - 1  # local index of each segment's last token
        ends_run = torch.cat([jump[1:], torch.tensor([True])])[end]
        run_last.append(ends_run)
        continues.append(ends_run & ~after[pos[end]])
        keyed += [(int(s), r, i) for i, s in enumerate(pos[off].tolist())]
        if int(pos[-1]) == seq_len - 1:
            last_owner = r
    order = tuple((r, i) for _, r, i in sorted(keyed))
    return SegmentPlan(tuple(offsets), tuple(lengths), tuple(starts), tuple(resets), order,
                       max(int(o.numel()) for o in offsets), last_owner, tuple(run_last), tuple(continues))


@dataclass(frozen=True)
class HaloPlan:
    """What the causal convolution of width ``K`` needs from the other ranks.

    Attributes:
        send: this rank's local indices whose inputs some other rank needs (sorted).
        count: the all-gather's rows per rank (the most any rank sends).
        index: LongTensor ``[n, K]``: for each local token and tap ``j`` (input at position
            ``p - (K - 1) + j``), the row of ``cat([local n rows, gathered P * count rows, zero row])``.
    """

    send: torch.Tensor
    count: int
    index: torch.Tensor


def halo_plan(seq_len: int, world_size: int, rank: int, layout, width: int, cu_seqlens=None) -> HaloPlan:
    """The :class:`HaloPlan` of ``rank`` for a causal convolution of ``width`` taps."""
    with host_side():
        return _halo_plan(seq_len, world_size, rank, layout, width, cu_seqlens)


def _halo_plan(seq_len: int, world_size: int, rank: int, layout, width: int, cu_seqlens) -> HaloPlan:
    positions = [p.long() for p in layout_positions(layout, seq_len, world_size)]
    n = positions[0].numel()
    owner = torch.empty(seq_len, dtype=torch.long)
    local_index = torch.empty(seq_len, dtype=torch.long)
    for r, pos in enumerate(positions):
        owner[pos] = r
        local_index[pos] = torch.arange(pos.numel())
    # a position is sent when a later position within width - 1 lives on another rank
    sent = torch.zeros(seq_len, dtype=torch.bool)
    for j in range(1, width):
        sent[:-j] |= owner[:-j] != owner[j:]
    send_slot = torch.full((seq_len,), -1, dtype=torch.long)
    counts = []
    for pos in positions:
        mine = pos[sent[pos]]
        send_slot[mine] = torch.arange(mine.numel())
        counts.append(mine.numel())
    count = max(counts)
    doc = torch.cumsum(doc_starts(seq_len, cu_seqlens).long(), 0)  # document number of every position
    pos = positions[rank]
    taps = pos.unsqueeze(1) - (width - 1) + torch.arange(width).unsqueeze(0)  # [n, K] input positions
    valid = taps >= 0
    src = taps.clamp_min(0)
    valid &= doc[src] == doc[pos].unsqueeze(1)  # never read across a document start
    here = owner[src] == rank
    index = torch.where(here, local_index[src], n + owner[src] * count + send_slot[src])
    index = torch.where(valid, index, torch.full_like(index, n + world_size * count))
    return HaloPlan(local_index[pos[sent[pos]]], count, index)

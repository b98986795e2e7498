"""Per-step plans: which block pairs a ring step computes, as pure functions.

A ring step pairs the queries of one rank (``q_rank``) with the keys/values of another
(``k_rank``). In the forward and in the KV-ring backward, K/V travel: at step ``t`` rank ``r``
holds the K/V of ``k_rank = (r - t) mod P`` and its own queries. In BurstAttention's
query-ring backward, Q travels: rank ``r`` holds the queries of ``q_rank = (r - t) mod P`` and
its own K/V. Either way the work is decided by the pair ``(q_rank, k_rank)`` alone:

``block_ops(q_rank, k_rank, world_size, layout, causal, local_len)`` returns the list of
:class:`BlockOp` to run, each a query slice x key slice of the two local shards with a mask
kind:

* ``FULL``: no mask.
* ``CAUSAL``: key ``j`` visible to query ``i`` iff ``j <= i`` (slices of equal length).
* ``STRICT``: iff ``j < i`` (striped layout, key rank after the query rank).

With ``causal=False`` every pair is one ``FULL`` op. With ``causal=True``:

* contiguous: diagonal pair ``CAUSAL``; key rank before query rank ``FULL``; after: nothing.
* zigzag (rank r holds chunks r and 2P-1-r, each of c = n/2 tokens): diagonal ``CAUSAL`` on
  the whole shard; ``k_rank < q_rank``: all queries x the first key chunk (``FULL``);
  ``k_rank > q_rank``: only the second query chunk x all keys (``FULL``). Every pair costs
  the same, which is what balances the ring.
* striped (token i on rank i mod P): local index j of rank s is global ``j*P + s``; so
  ``k_rank <= q_rank`` is ``CAUSAL`` and ``k_rank > q_rank`` is ``STRICT``.

Fully masked pairs produce no op and are skipped; the ring still forwards their data,
since later ranks need it.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Optional

import torch


class MaskKind(str, Enum):
    """Mask inside one block op; see the module docstring."""

    FULL = "full"
    CAUSAL = "causal"
    STRICT = "strict"
    PARTIAL = "partial"  # an explicit mask block (masks, see burstattn.masks.blocks)


@dataclass(frozen=True)
class BlockOp:
    """One local kernel call: rows ``[q_start, q_stop)`` of the query shard against rows
    ``[k_start, k_stop)`` of the key/value shard, with ``mask``."""

    q_start: int
    q_stop: int
    k_start: int
    k_stop: int
    mask: MaskKind

    @property
    def cost(self) -> float:
        """Score-matrix entries computed (the attention FLOPs up to a constant)."""
        area = (self.q_stop - self.q_start) * (self.k_stop - self.k_start)
        return area / 2 if self.mask in (MaskKind.CAUSAL, MaskKind.STRICT) else float(area)


def tile_op(op: BlockOp, size: int) -> tuple[BlockOp, ...]:
    """``op`` cut into tiles of at most ``size x size`` (pure). FULL and PARTIAL ops become a grid
    of tiles of their kind; a CAUSAL or STRICT square keeps its lower triangle of tiles: the
    diagonal tiles keep the kind (the rows and keys of such a tile start together), the tiles
    below it are FULL and the ones above it are dropped."""
    nq, nk = op.q_stop - op.q_start, op.k_stop - op.k_start
    if nq <= size and nk <= size:
        return (op,)
    tri = op.mask in (MaskKind.CAUSAL, MaskKind.STRICT)
    tiles = []
    for i in range(0, nq, size):
        for j in range(0, (i + 1 if tri else nk), size):
            kind = (op.mask if i == j else MaskKind.FULL) if tri else op.mask
            tiles.append(BlockOp(op.q_start + i, min(op.q_start + i + size, op.q_stop),
                                 op.k_start + j, min(op.k_start + j + size, op.k_stop), kind))
    return tuple(tiles)


def block_ops(q_rank: int, k_rank: int, world_size: int, layout: str, causal: bool,
              local_len: int) -> tuple[BlockOp, ...]:
    """The block ops for queries of ``q_rank`` against keys of ``k_rank`` (see module doc)."""
    n = local_len
    if not causal:
        return (BlockOp(0, n, 0, n, MaskKind.FULL),)
    if q_rank == k_rank:
        return (BlockOp(0, n, 0, n, MaskKind.CAUSAL),)
    before = k_rank < q_rank
    if layout == "contiguous":
        return (BlockOp(0, n, 0, n, MaskKind.FULL),) if before else ()
    if layout == "zigzag":
        c = n // 2
        return (BlockOp(0, n, 0, c, MaskKind.FULL),) if before else (BlockOp(c, n, 0, n, MaskKind.FULL),)
    if layout == "striped":
        return (BlockOp(0, n, 0, n, MaskKind.CAUSAL if before else MaskKind.STRICT),)
    raise ValueError(f"unknown layout {layout!r}")


def ring_source(rank: int, step: int, world_size: int) -> int:
    """The rank whose travelling block sits on ``rank`` at ``step`` (blocks move r -> r+1)."""
    return (rank - step) % world_size


@dataclass(frozen=True)
class StepPlan:
    """What ``rank`` does at ring step ``step``.

    Attributes:
        q_rank, k_rank: owners of the query shard and the key/value shard paired at this step.
        ops: the block ops to compute (empty: nothing to compute, the data only passes by).
        prefetch: whether the next step's travelling block is received during this step.
    """

    step: int
    q_rank: int
    k_rank: int
    ops: tuple[BlockOp, ...]
    prefetch: bool


def ring_plan(rank: int, world_size: int, layout: str, causal: bool, local_len: int,
              travelling: str) -> tuple[StepPlan, ...]:
    """The full P-step plan of ``rank``; ``travelling`` is ``"kv"`` or ``"q"``."""
    if travelling not in ("kv", "q"):
        raise ValueError(f"travelling must be 'kv' or 'q', got {travelling!r}")
    plans = []
    for t in range(world_size):
        src = ring_source(rank, t, world_size)
        q_rank, k_rank = (rank, src) if travelling == "kv" else (src, rank)
        plans.append(StepPlan(t, q_rank, k_rank,
                              block_ops(q_rank, k_rank, world_size, layout, causal, local_len),
                              prefetch=t < world_size - 1))
    return tuple(plans)


def rank_cost(rank: int, world_size: int, layout: str, causal: bool, local_len: int) -> float:
    """Score entries ``rank`` computes over a forward (for the balance figure)."""
    return sum(op.cost for p in ring_plan(rank, world_size, layout, causal, local_len, "kv")
               for op in p.ops)


@dataclass(frozen=True)
class DirectStep:
    """One step of a direct (non-ring) schedule for one rank: data goes straight from its
    owner to the rank that computes with it, and partial results go straight back.

    Attributes:
        step: step index (0 is the rank's own diagonal block).
        own_k: compute this rank's queries against the K/V of ``own_k`` (received from it,
            or local when ``own_k == rank``); ``None``: no such work.
        helper_q: compute the queries of ``helper_q`` (received from it) against this rank's
            K/V and send the partial result back; ``None``: no helper work.
        kv_to: the rank that computes with this rank's K/V at this step (send them to it).
        q_to: the rank that computes this rank's queries at this step as a helper.
        own_part, helper_part: ``(i, parts)``: only query rows ``[i*n/parts, (i+1)*n/parts)`` of
            that work (``None``: all rows). The helper's result still covers every row (the
            others with LSE ``-inf``, which the merge ignores).
    """

    step: int
    own_k: Optional[int]
    helper_q: Optional[int]
    kv_to: Optional[int]
    q_to: Optional[int]
    own_part: Optional[tuple[int, int]] = None
    helper_part: Optional[tuple[int, int]] = None


def part_rows(part: Optional[tuple[int, int]], n: int) -> slice:
    """The query rows of a :class:`DirectStep` part for ``n`` local rows."""
    if part is None:
        return slice(0, n)
    i, parts = part
    return slice(i * n // parts, (i + 1) * n // parts)


def distflash_plan(rank: int, world_size: int) -> tuple[DirectStep, ...]:
    """DistFlashAttn's load-balanced causal schedule over the contiguous layout (pure).

    Step 0: every rank computes its causal diagonal block. Step t = 1 .. P//2: rank r >= t
    computes Q_r x K_(r-t) with K/V sent directly by rank r-t; a rank r < t would be idle,
    so (while 2t < P) it helps the overloaded rank r+P-t: it receives Q_(r+P-t), computes it
    against its own K_r and returns the partial (output, LSE) for rank r+P-t to merge. Step t
    thus covers the block distances t and P-t, and steps 1..P//2 cover every pair (i, j < i)
    exactly once. For even P the last step (t = P/2) has one distance only: rank r >= P/2
    computes the first half of Q_r's rows against K_(r-P/2) and rank r-P/2 the second half
    against its own K/V, so every rank does half a block there. Every rank then does the same
    work, P/2 blocks (the causal half of the P x P block matrix, P^2/2 blocks, spread evenly):
    the causal run takes about half the time of the non-causal ring.
    """
    steps = [DirectStep(0, rank, None, None, None)]
    half = world_size // 2
    for t in range(1, half + 1):
        if 2 * t == world_size:  # last step, even P: split Q_(r+t) x K_r between ranks r+t and r
            late = rank >= t
            steps.append(DirectStep(
                step=t, own_k=rank - t if late else None, helper_q=None if late else rank + t,
                kv_to=None if late else rank + t, q_to=rank - t if late else None,
                own_part=(0, 2) if late else None, helper_part=None if late else (1, 2)))
            continue
        steps.append(DirectStep(
            step=t,
            own_k=rank - t if rank >= t else None,
            helper_q=rank + world_size - t if rank < t else None,
            kv_to=rank + t if rank + t < world_size else None,
            q_to=rank - (world_size - t) if rank >= world_size - t else None))
    return tuple(steps)


def distflash_cost(rank: int, world_size: int, local_len: int) -> float:
    """Score entries ``rank`` computes over a forward under :func:`distflash_plan` (the diagonal
    block counts half, a half step half a block)."""
    n = local_len
    total = 0.0
    for st in distflash_plan(rank, world_size):
        if st.own_k is not None:
            rows = part_rows(st.own_part, n)
            total += (rows.stop - rows.start) * n / (2 if st.own_k == rank else 1)
        if st.helper_q is not None:
            rows = part_rows(st.helper_part, n)
            total += (rows.stop - rows.start) * n
    return total


def position_ops(q_pos, k_pos, causal: bool) -> tuple[BlockOp, ...]:
    """The block ops of a query shard against a key shard from their *global positions* (pure).

    ``q_pos [nq]`` and ``k_pos [nk]`` are integer tensors of any lengths (a 1-token decode query
    against a long cache shard, a short continuation after it); ``k_pos`` must increase (every
    layout's shards do). Causal: query i sees the keys at positions <= its own, i.e. the index
    range ``[0, b_i)`` with ``b = searchsorted(k_pos, q_pos, right=True)``. Rows with a constant
    ``b`` are one FULL op on ``[0, b)``; rows where ``b`` grows by one per row are a FULL op on the
    keys all of them see plus a CAUSAL square (STRICT when the first row sees nothing). The three
    layouts at equal lengths come out as one op per pair, the same calls as :func:`block_ops`.
    """
    nq, nk = int(q_pos.numel()), int(k_pos.numel())
    if nq == 0 or nk == 0:
        return ()
    if not causal:
        return (BlockOp(0, nq, 0, nk, MaskKind.FULL),)
    if nk > 1 and not bool((k_pos[1:] > k_pos[:-1]).all()):
        raise ValueError("position_ops: key positions must increase")
    b = torch.searchsorted(k_pos.to(torch.int64), q_pos.to(torch.int64), right=True).tolist()
    ops: list[BlockOp] = []
    i = 0
    while i < nq:
        step = b[i + 1] - b[i] if i + 1 < nq else 0
        j = i + 1
        if step in (0, 1):
            while j < nq and b[j] - b[j - 1] == step:
                j += 1
        else:
            step = 0
        if step == 0:
            if b[i] > 0:
                ops.append(BlockOp(i, j, 0, b[i], MaskKind.FULL))
        elif b[i] == 0:  # row i sees nothing, row i+s the first s keys: j < i
            ops.append(BlockOp(i, j, 0, j - i, MaskKind.STRICT) if j - i <= nk else
                       BlockOp(i + 1, j, 0, j - i - 1, MaskKind.CAUSAL))
        else:
            if b[i] > 1:
                ops.append(BlockOp(i, j, 0, b[i] - 1, MaskKind.FULL))
            ops.append(BlockOp(i, j, b[i] - 1, b[i] - 1 + j - i, MaskKind.CAUSAL))
        i = j
    return tuple(ops)

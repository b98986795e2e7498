"""Document-aware sequence partitions for packed documents.

A global sequence of N tokens holds packed documents, described as in flash-attn's varlen API
by ``cu_seqlens`` (cumulative lengths: 1-D ints, starts at 0, strictly increasing, ends at N).
A token attends only to keys of its own document (and, when causal, only to keys at positions
<= its own; a sliding ``window = (left, right)`` keeps keys ``i - left <= j <= i + right``).
The work of a token is the number of keys it sees; the work of a rank is the sum over its tokens.

The named layouts of :mod:`burstattn.layouts.named` ignore documents: ``contiguous`` keeps documents on
few ranks but is imbalanced, ``zigzag`` balances plain causal attention but cuts every document.
:func:`document_partition` builds an explicit :class:`Partition` that balances the work and cuts
few documents. Everything here is a pure function of its arguments (no process group).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import torch

from ..config import Window, checksum, normalize_window
from .cut import _cut  # noqa: F401  (partition._cut: the solver's name for it)
from .named import local_positions
CuSeqlens = Union[torch.Tensor, Sequence[int]]


@dataclass(frozen=True, eq=False)
class Partition:
    """An explicit layout: the global positions every rank holds.

    Attributes:
        positions: one int64 CPU tensor ``[n]`` per rank, strictly increasing; the ranks' sets
            are disjoint, their union is ``arange(N)`` and every rank holds ``n = N / P`` tokens.
            Other integer dtypes and devices are converted on construction.
        name: a label shown in ``repr`` (not part of the fingerprint).

    Raises ``ValueError`` (``TypeError`` for non-tensors) naming the first violated condition.
    """

    positions: tuple[torch.Tensor, ...]
    name: str = "documents"
    _fingerprint: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        parts = _checked_positions(self.positions)
        object.__setattr__(self, "positions", parts)
        object.__setattr__(self, "_fingerprint", _fingerprint_of(parts))

    @property
    def world_size(self) -> int:
        """Number of ranks P."""
        return len(self.positions)

    @property
    def local_len(self) -> int:
        """Tokens per rank n."""
        return int(self.positions[0].numel())

    @property
    def seq_len(self) -> int:
        """Global sequence length N = n * P."""
        return self.local_len * self.world_size

    def positions_of(self, rank: int) -> torch.Tensor:
        """Global positions ``rank`` holds: int64 ``[n]``, increasing (the stored tensor, not a copy)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        return self.positions[rank]

    @property
    def fingerprint(self) -> int:
        """CRC-32 of ``(P, n)`` and the positions as little-endian int64: equal across processes."""
        return self._fingerprint

    def __repr__(self) -> str:
        return (f"Partition(name={self.name!r}, world_size={self.world_size}, "
                f"seq_len={self.seq_len}, fingerprint={self.fingerprint:#010x})")


def _is_int_vector(t: torch.Tensor) -> bool:
    return t.dim() == 1 and not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)


def _checked_positions(positions: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    if not isinstance(positions, (tuple, list)) or not positions:
        raise ValueError(f"positions must be a non-empty tuple of tensors, got {type(positions).__name__}")
    parts = []
    for r, p in enumerate(positions):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"positions[{r}] must be a torch.Tensor, got {type(p).__name__}")
        if not _is_int_vector(p):
            raise ValueError(f"positions[{r}] must be a 1-D integer tensor, got shape "
                             f"{tuple(p.shape)} dtype {p.dtype}")
        parts.append(p.to("cpu", torch.int64).contiguous())
    n = parts[0].numel()
    for r, p in enumerate(parts):
        if p.numel() != n or n == 0:
            raise ValueError(f"every rank must hold the same positive number of tokens: positions[0] "
                             f"has {n}, positions[{r}] has {p.numel()}")
    grid = torch.stack(parts)  # [P, n]: one check for all ranks (1,024 ranks: no loop of tensor calls)
    falling = (grid[:, 1:] <= grid[:, :-1]).any(1)
    if bool(falling.any()):
        raise ValueError(f"positions[{int(torch.nonzero(falling)[0])}] must be strictly increasing")
    flat, total = grid.flatten(), grid.numel()
    inside = bool((flat >= 0).all()) and bool((flat < total).all())
    # N positions in [0, N), each seen: a permutation of arange(N) (O(N), no sort)
    if not inside or not bool(torch.zeros(total, dtype=torch.bool).index_fill_(0, flat, True).all()):
        raise ValueError(f"the ranks' positions must be disjoint and cover arange({total}) exactly")
    return tuple(parts)


def _fingerprint_of(parts: tuple[torch.Tensor, ...]) -> int:
    # one CRC over (P, n) and the ranks' positions in order (int64; the bytes as on a little-endian host)
    return checksum(torch.cat(parts).to(torch.int64), checksum(struct.pack("<qq", len(parts), parts[0].numel())))


def _check_cu_seqlens(cu_seqlens: CuSeqlens, seq_len: Optional[int] = None) -> torch.Tensor:
    """``cu_seqlens`` as an int64 CPU tensor ``[D + 1]``, or ``ValueError``/``TypeError``."""
    if isinstance(cu_seqlens, torch.Tensor):
        if not _is_int_vector(cu_seqlens):
            raise ValueError(f"cu_seqlens must be a 1-D integer tensor, got shape "
                             f"{tuple(cu_seqlens.shape)} dtype {cu_seqlens.dtype}")
        cu = cu_seqlens.to("cpu", torch.int64)
    elif isinstance(cu_seqlens, (list, tuple)):
        bad = [v for v in cu_seqlens if not isinstance(v, int) or isinstance(v, bool)]
        if bad:
            raise TypeError(f"cu_seqlens must hold ints, got {bad[0]!r}")
        cu = torch.tensor(list(cu_seqlens), dtype=torch.int64)
    else:
        raise TypeError(f"cu_seqlens must be a list/tuple of ints or a 1-D integer tensor, "
                        f"got {type(cu_seqlens).__name__}")
    if cu.numel() < 2:
        raise ValueError(f"cu_seqlens must hold at least 2 entries (0 and N), got {cu.tolist()}")
    if int(cu[0]) != 0:
        raise ValueError(f"cu_seqlens must start at 0, got cu_seqlens[0] = {int(cu[0])}")
    steps = cu[1:] - cu[:-1]
    if bool((steps <= 0).any()):
        i = int(torch.nonzero(steps <= 0)[0]) + 1
        raise ValueError(f"cu_seqlens must be strictly increasing, got cu_seqlens[{i}] = {int(cu[i])} "
                         f"<= cu_seqlens[{i - 1}] = {int(cu[i - 1])}")
    if seq_len is not None and int(cu[-1]) != seq_len:
        raise ValueError(f"cu_seqlens must end at seq_len = {seq_len}, got cu_seqlens[-1] = {int(cu[-1])}")
    return cu


def _check_world_size(world_size: int) -> None:
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")


def token_work(seq_len: int, *, causal: bool, cu_seqlens: Optional[CuSeqlens] = None,
               window: Window = None) -> torch.Tensor:
    """Number of keys every global position attends to: float64 ``[seq_len]``.

    Token ``i`` of the document ``[s, e)`` sees keys ``j`` in ``[s, e)`` with ``j <= i`` when
    ``causal`` and ``i - left <= j <= i + right`` for ``window = (left, right)`` (``None`` =
    unbounded), so ``i - s + 1`` (causal) or ``e - s`` (non-causal) without a window.
    ``cu_seqlens=None`` means one document of the whole sequence. Raises ``ValueError`` for a
    non-positive ``seq_len``, a ``cu_seqlens`` not starting at 0, not strictly increasing or
    not ending at ``seq_len``, or a bad ``window`` (see :func:`burstattn.config.normalize_window`).
    """
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len <= 0:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    left, right = normalize_window(window) or (None, None)
    cu = torch.tensor([0, seq_len]) if cu_seqlens is None else _check_cu_seqlens(cu_seqlens, seq_len)
    doc = torch.repeat_interleave(torch.arange(cu.numel() - 1), cu[1:] - cu[:-1])  # [N]
    i = torch.arange(seq_len)
    lo = cu[:-1][doc]  # first key: the document start ...
    hi = i if causal else cu[1:][doc] - 1  # last key
    if left is not None:
        lo = torch.maximum(lo, i - left)  # ... or the window's left edge
    if right is not None:
        hi = torch.minimum(hi, i + right)
    return (hi - lo + 1).to(torch.float64)


def _stream(cu: torch.Tensor, work: torch.Tensor, fold: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Global positions in cutting order ``[N]`` and the document boundaries in it (bool ``[N+1]``).

    Documents come densest first (mean work per token, ties by index). Inside a document the
    order folds the ends together (offsets 0, L-1, 1, L-2, ...) when ``fold``: a run of the
    stream is then a zigzag pair of pieces of the document, whose causal work is proportional
    to its length.
    """
    n_tok = work.numel()
    lengths = cu[1:] - cu[:-1]  # [D]
    cum = torch.cat([work.new_zeros(1), work.cumsum(0)])  # [N+1]
    density = (cum[cu[1:]] - cum[cu[:-1]]) / lengths
    order = torch.sort(-density, stable=True).indices  # [D], densest first
    sizes, starts = lengths[order], cu[:-1][order]
    first = torch.cumsum(sizes, 0) - sizes  # where each document begins in the stream
    doc = torch.repeat_interleave(torch.arange(order.numel()), sizes)  # [N] stream -> sorted doc
    k = torch.arange(n_tok) - first[doc]  # index inside the document's run
    offset = torch.where(k % 2 == 0, k // 2, sizes[doc] - 1 - k // 2) if fold else k
    boundary = torch.zeros(n_tok + 1, dtype=torch.bool)
    boundary[first] = True
    boundary[n_tok] = True
    return starts[doc] + offset, boundary


def document_partition(cu_seqlens: CuSeqlens, world_size: int, *, causal: bool = True,
                       window: Window = None, tolerance: float = 0.01) -> Partition:
    """A partition of the packed documents ``cu_seqlens`` over ``world_size`` ranks.

    Every rank gets exactly ``n = N / P`` tokens (``N = cu_seqlens[-1]``). The documents are
    ordered densest first (mean work per token, see :func:`token_work`), each folded
    end-to-end when causal or windowed (a run of it is a zigzag pair of its pieces); rank r
    then takes one run from the dense end and one from the sparse end of that stream, sized
    so its work is within ``tolerance`` of the mean; inside that band it prefers cuts at
    document boundaries, swapping whole documents of the sparse end in and out to land on one.
    A document is thus split only where balance needs it. When every rank finds a size in the
    band (a token's work is small against ``tolerance * mean``), every rank's work, the last
    one's included, is within ``(1 +- tolerance) * mean``.

    Args:
        cu_seqlens: list/tuple of ints or 1-D integer tensor ``[D + 1]``.
        world_size: P >= 1, must divide N.
        causal, window: the attention mask, as in :func:`token_work`.
        tolerance: allowed relative deviation of a rank's work from the mean, traded for fewer
            document cuts (0 = balance only). In ``[0, 1)``.
    Returns:
        A :class:`Partition` named ``"documents"``. Deterministic; O(N) tensor work.
    Raises:
        ValueError: invalid ``cu_seqlens``/``window``/``tolerance``, or N not divisible by P.
    """
    _check_world_size(world_size)
    cu = _check_cu_seqlens(cu_seqlens)
    if not isinstance(tolerance, (int, float)) or not 0.0 <= tolerance < 1.0:
        raise ValueError(f"tolerance must be a float in [0, 1), got {tolerance!r}")
    seq_len = int(cu[-1])
    if seq_len % world_size:
        raise ValueError(f"sequence length N = cu_seqlens[-1] = {seq_len} cannot be split over "
                         f"world_size = {world_size} ranks: N must be a multiple of world_size")
    work = token_work(seq_len, causal=causal, cu_seqlens=cu, window=window)
    stream, boundary = _stream(cu, work, fold=causal or window is not None)
    parts = _cut(stream, work[stream], boundary, world_size, float(tolerance))
    return Partition(tuple(p.sort().values for p in parts), name="documents")


def balance(work_per_rank: Union[torch.Tensor, Sequence[float]]) -> float:
    """Max over mean of the ranks' work (1.0 = perfect; also 1.0 when no rank has work). The one
    balance figure of the package (``burstattn.masks.balance`` is this function).
    Raises ``ValueError`` if empty or negative."""
    w = torch.as_tensor(work_per_rank, dtype=torch.float64).flatten()
    if w.numel() == 0 or bool((w < 0).any()):
        raise ValueError(f"work_per_rank must be non-empty and non-negative (a positive sum, or all zeros), "
                         f"got {w.tolist()}")
    total = float(w.sum())
    return float(w.max() / w.mean()) if total > 0 else 1.0


def partition_work(partition: Union[Partition, Sequence[torch.Tensor]], work: torch.Tensor) -> torch.Tensor:
    """Work of every rank of a partition: float64 ``[P]``, ``work[positions_of(r)].sum()``.

    Args:
        partition: a :class:`Partition` or a list of per-rank position tensors.
        work: ``[N]`` per-token work (e.g. :func:`token_work`).
    (The score entries each rank's kernels compute under a mask are :func:`burstattn.masks.rank_work`.)
    """
    parts = partition.positions if isinstance(partition, Partition) else list(partition)
    if work.dim() != 1:
        raise ValueError(f"work must be 1-D [N], got shape {tuple(work.shape)}")
    total = sum(int(p.numel()) for p in parts)
    if total != work.numel():
        raise ValueError(f"the positions hold {total} tokens but work has {work.numel()}")
    w = work.to(torch.float64)
    return torch.stack([w[p.long()].sum() for p in parts])


def layout_positions(layout: Union[str, Partition], seq_len: int, world_size: int) -> list[torch.Tensor]:
    """Positions of every rank, ``P`` int64 tensors ``[N / P]``, for a layout name or a Partition.

    Raises ``ValueError`` if a Partition's sequence length or world size differ from the
    arguments, or as :func:`burstattn.layouts.named.local_positions` for a named layout.
    """
    if isinstance(layout, Partition):
        if (layout.seq_len, layout.world_size) != (seq_len, world_size):
            raise ValueError(f"{layout!r} does not match seq_len = {seq_len}, world_size = {world_size}")
        return list(layout.positions)
    if not isinstance(layout, str):
        raise TypeError(f"layout must be a layout name or a Partition, got {type(layout).__name__}")
    return [local_positions(seq_len, r, world_size, layout) for r in range(world_size)]


def document_spread(partition: Union[Partition, Sequence[torch.Tensor]],
                    cu_seqlens: CuSeqlens) -> torch.Tensor:
    """Number of ranks holding tokens of each document: int64 ``[D]`` (1 = not split)."""
    parts = partition.positions if isinstance(partition, Partition) else list(partition)
    seq_len = sum(int(p.numel()) for p in parts)
    cu = _check_cu_seqlens(cu_seqlens, seq_len)
    spread = torch.zeros(cu.numel() - 1, dtype=torch.int64)
    for p in parts:
        docs = torch.bucketize(p.long(), cu[1:], right=True)  # document of every position
        spread[torch.unique(docs)] += 1
    return spread

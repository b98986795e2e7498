"""The planner's search over blockwise chunk sizes (pure).

A chunk of the MLP or the loss bounds that part's transient memory (smaller chunks, less memory),
and each chunk costs a fixed overhead (kernel launches, the weights read again:
:func:`burstattn.sim.step.chunk_overhead`), so the best chunks are the largest that fit: fewest
chunks. ``burstattn train``'s automatic chunks are one point of this ladder; the search tries every
power of two from :data:`SMALLEST` up to the local rows, so ``plan --max-seq-len`` at a small memory
finds the chunks that make a long sequence fit (small-l3 at 0.125 GiB: 512 / 256, as ``bench train
--max-len`` measured, where the automatic chunks stopped at 1,024 tokens).
"""
from __future__ import annotations

from typing import Callable, Optional

SMALLEST = 64
"""The smallest chunk tried (tokens): below it the per-chunk overhead dominates any memory saved."""
LARGEST = 1 << 16


def ladder(rows: int, fixed: Optional[int] = None) -> list[int]:
    """Chunk sizes to try for ``rows`` local rows, largest first: ``[fixed]`` when given, else the powers
    of two from :data:`SMALLEST` below ``rows`` (a chunk of ``rows`` or more is the whole), or ``[0]``
    (whole) when ``rows`` is no more than :data:`SMALLEST`."""
    if fixed is not None:
        return [fixed]
    sizes = [c for c in (1 << k for k in range(LARGEST.bit_length())) if SMALLEST <= c < rows]
    return sorted(sizes, reverse=True) or [0]


def count(rows: int, chunk: int) -> int:
    """Chunks of ``chunk`` rows over ``rows`` rows (``chunk == 0``: whole, one)."""
    return 1 if chunk <= 0 or chunk >= rows else -(-rows // chunk)


def pairs(rows: int, mlp: Optional[int] = None, loss: Optional[int] = None) -> list[tuple[int, int]]:
    """Every ``(mlp_chunk, loss_chunk)`` of the ladders, fewest chunks first (ties: the larger MLP chunk)."""
    out = [(m, x) for m in ladder(rows, mlp) for x in ladder(rows, loss)]
    return sorted(out, key=lambda p: (count(rows, p[0]) + count(rows, p[1]), -p[0]))


def frugal(rows: int, mlp: Optional[int] = None, loss: Optional[int] = None) -> tuple[int, int]:
    """The pair that holds the least memory: the smallest of each ladder."""
    return ladder(rows, mlp)[-1], ladder(rows, loss)[-1]


def search_chunks(fits: Callable[[int, int], bool], rows: int, mlp: Optional[int] = None,
                  loss: Optional[int] = None) -> Optional[tuple[int, int]]:
    """The pair of :func:`pairs` with the fewest chunks for which ``fits(mlp_chunk, loss_chunk)``, else
    ``None``. ``mlp`` / ``loss``: a fixed size instead of that ladder. Memory falls as either chunk
    shrinks, so when the :func:`frugal` pair does not fit, none does (one call)."""
    if not fits(*frugal(rows, mlp, loss)):
        return None
    for pair in pairs(rows, mlp, loss):
        if fits(*pair):
            return pair
    return None

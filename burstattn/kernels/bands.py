"""One block pair's mask as varlen flash calls (pure, host side): the ``cum_seq_q`` / ``cum_seq_k`` and
``window_size_left`` / ``window_size_right`` that make a flash kernel apply the mask itself.

Input: for each query row ``i`` of the pair, the index range ``[a_i, b_i)`` of the key shard it sees
(causal, windows and documents make it one range: :func:`burstattn.masks.blocks.visible_ranges`;
``a_i >= b_i``: the row sees nothing here). A flash varlen call runs *segments*: segment ``s`` takes
``m`` packed query rows and ``sk`` packed keys, and local query ``i`` sees local key ``j`` iff
``i + sk - m - L <= j <= i + sk - m + R`` (bottom-right alignment; ``L`` / ``R`` the call's
``window_size_left`` / ``_right``, ``-1`` unbounded). So within one segment ``a`` is flat, then grows by
one per row, and ``b`` grows by one per row, then is flat: an *atom*. The rows are cut into atoms (every
row in exactly one; rows that see nothing in none), each atom's key box is ``[a_first, b_last)``, and its
band gives ``L`` and ``R``:

* ``b`` constant: any ``R >= m - 1`` (or ``-1``); else exactly ``R = b_first - b_last + m - 1`` (the length
  of ``b``'s flat tail; an atom whose tail is not shorter than its keys is cut, since flash turns a
  window ``>= max_k`` into ``-1``);
* ``a`` constant: any ``L >= sk - 1`` (or ``-1``); else exactly ``L = b_last - 1 - a_last``.

Atoms that agree on ``(L, R)`` share one call (all of them, for documents and for windows over contiguous
or striped shards; a window that reaches across zigzag's gap between a rank's two chunks needs two or
three rules: that many calls). The atoms are cut two ways (as long as their shape allows, and also where
a row sees none of the previous row's keys: a new document); the way with fewer calls is taken. The packed queries are the atoms' rows in order, the packed keys their key boxes in order (a copy
only where the boxes are not one run: documents that skip keys, windows whose boxes overlap).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

MAX_CALLS = 4  # more rules than this in one pair: the pair keeps the engine's tiles
MAX_KEY_COPIES = 2  # packed keys beyond this many times the pair's keys: the tiles (overlapping boxes)


@dataclass(frozen=True)
class Atom:
    """Rows ``[q0, q1)`` against keys ``[k0, k1)`` with their band: ``l`` / ``r`` exact window sizes, or
    ``None`` with the least value that still holds (``l_min`` / ``r_min``; ``-1`` always holds)."""

    q0: int
    q1: int
    k0: int
    k1: int
    l: Optional[int]
    l_min: int
    r: Optional[int]
    r_min: int


@dataclass(frozen=True)
class BandCall:
    """One varlen flash call of a pair: segments over packed rows and keys.

    ``cu_q`` / ``cu_k``: cumulative segment lengths (``[0, ..., total]``); ``q_runs`` / ``k_runs``: the
    pair's row and key ranges packed in order (``((start, stop), ...)``, merged where adjacent);
    ``window``: ``(window_size_left, window_size_right)``, ``-1`` unbounded; ``causal``: the window is
    ``(-1, 0)`` (passed as ``is_causal``)."""

    cu_q: tuple
    cu_k: tuple
    q_runs: tuple
    k_runs: tuple
    window: tuple

    @property
    def max_q(self) -> int:
        return max(b - a for a, b in zip(self.cu_q, self.cu_q[1:]))

    @property
    def max_k(self) -> int:
        return max(b - a for a, b in zip(self.cu_k, self.cu_k[1:]))

    @property
    def causal(self) -> bool:
        return self.window == (-1, 0)


@dataclass(frozen=True)
class PairBands:
    """A pair's varlen calls; ``rows`` / ``keys``: the ``(start, stop)`` span of rows and keys they touch."""

    calls: tuple
    rows: tuple
    keys: tuple


def _atom(a: list, b: list, s: int, e: int) -> Atom:
    ks, ke, m = a[s], b[e - 1], e - s
    sk = ke - ks
    r = None if b[s] == ke else b[s] - ke + m - 1
    l = None if a[e - 1] == ks else ke - 1 - a[e - 1]
    return Atom(s, e, ks, ke, l, sk - 1, r, m - 1)


def _fits(db: int, da: int, state: list) -> bool:
    """Whether one more row with differences ``da`` / ``db`` keeps the atom's shape (``a``: flat then +1;
    ``b``: +1 then flat); updates ``state = [a sloping, b flat]``."""
    if da not in (0, 1) or db not in (0, 1) or (da == 0 and state[0]) or (db == 1 and state[1]):
        return False
    state[0] |= da == 1
    state[1] |= db == 0
    return True


def atoms(a: torch.Tensor, b: torch.Tensor, split_disjoint: bool = False) -> list[Atom]:
    """The atoms of rows with visible key ranges ``[a_i, b_i)`` (LongTensors ``[n]``), in row order, each as
    long as its shape allows; ``split_disjoint``: also a new atom where a row sees none of the keys of the
    row before (a new document: its band need not join the previous one's)."""
    al, bl = a.tolist(), b.tolist()
    out, s, state = [], None, [False, False]
    for i in range(len(al) + 1):
        live = i < len(al) and al[i] < bl[i]
        if (s is not None and live and not (split_disjoint and al[i] >= bl[i - 1])
                and _fits(bl[i] - bl[i - 1], al[i] - al[i - 1], state)):
            continue
        if s is not None:
            out.extend(_split_tail(al, bl, s, i))
        s, state = (i, [False, False]) if live else (None, [False, False])
    return out


def _split_tail(a: list, b: list, s: int, e: int) -> list[Atom]:
    """The atom ``[s, e)``, cut where ``b``'s flat tail is not shorter than its keys (see the module)."""
    atom = _atom(a, b, s, e)
    if atom.r is None or atom.r < atom.k1 - atom.k0:
        return [atom]
    cut = e - atom.r  # the first row of the flat tail of b, after the slope's last row
    return [_atom(a, b, s, cut), _atom(a, b, cut, e)]


def _side(exact: Optional[int], least: int, atoms_: list, name: str) -> Optional[int]:
    """The call's value of one side for ``atoms_`` plus an atom (``exact``, ``least``); ``None`` if they
    cannot share it; ``-1`` when every atom takes an unbounded side."""
    values = {getattr(x, name) for x in atoms_ if getattr(x, name) is not None} | ({exact} - {None})
    if len(values) > 1:
        return None
    if not values:
        return -1
    v = values.pop()
    mins = [getattr(x, name + "_min") for x in atoms_ if getattr(x, name) is None]
    if exact is None:
        mins.append(least)
    return v if all(v >= m for m in mins) else None


def _runs(ranges: list) -> tuple:
    out: list = []
    for a, b in ranges:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return tuple(out)


def _call(group: list) -> BandCall:
    left = _side(None, 0, group, "l")
    right = _side(None, 0, group, "r")
    cu_q, cu_k = [0], [0]
    for x in group:
        cu_q.append(cu_q[-1] + x.q1 - x.q0)
        cu_k.append(cu_k[-1] + x.k1 - x.k0)
    return BandCall(tuple(cu_q), tuple(cu_k), _runs([(x.q0, x.q1) for x in group]),
                    _runs([(x.k0, x.k1) for x in group]), (left, right))


def _groups(atoms_: list) -> list[list]:
    """Atoms in calls: each joins the first call whose window it shares (row order kept in each call)."""
    groups: list[list] = []
    for x in atoms_:
        for g in groups:
            if _side(x.l, x.l_min, g, "l") is not None and _side(x.r, x.r_min, g, "r") is not None:
                g.append(x)
                break
        else:
            groups.append([x])
    return groups


def pair_bands(a: torch.Tensor, b: torch.Tensor, n_k: int) -> Optional[PairBands]:
    """The varlen calls of a pair whose query rows see key ranges ``[a_i, b_i)`` of ``n_k`` keys (pure).
    ``None`` when the pair needs more than :data:`MAX_CALLS` calls or its packed keys exceed
    :data:`MAX_KEY_COPIES` times ``n_k`` (then it keeps the engine's tiles)."""
    groups = min((_groups(atoms(a, b, split)) for split in (False, True)),
                 key=lambda gs: (len(gs), sum(len(g) for g in gs)))
    if len(groups) > MAX_CALLS:
        return None
    calls = tuple(_call(g) for g in groups)
    if sum(c.cu_k[-1] for c in calls) > MAX_KEY_COPIES * max(n_k, 1):
        return None
    every = [x for g in groups for x in g]
    if not every:
        return PairBands((), (0, 0), (0, 0))
    return PairBands(calls, (min(x.q0 for x in every), max(x.q1 for x in every)),
                     (min(x.k0 for x in every), max(x.k1 for x in every)))


def flash_window(window: tuple, max_k: int, causal_flag: bool = False) -> tuple[int, int]:
    """The window a flash varlen call applies for ``(left, right)`` as passed: PyTorch's and flash-attn's
    ``mha_varlen_fwd`` turn a side ``>= max_k`` into ``-1`` and ``is_causal`` into a right side of 0."""
    left, right = window
    if causal_flag:
        right = 0
    left = -1 if left >= max_k else left
    right = -1 if right >= max_k else right
    return left, right


def segment_ranges(call: BandCall) -> list[tuple[int, int, int, int, int, int]]:
    """Per segment of ``call``, ``(q0, q1, k0, k1, left, right)`` in packed indices with the window as the
    kernel applies it (:func:`flash_window`): what a reference reads."""
    left, right = flash_window(call.window, call.max_k, call.causal)
    return [(call.cu_q[s], call.cu_q[s + 1], call.cu_k[s], call.cu_k[s + 1], left, right)
            for s in range(len(call.cu_q) - 1)]


def band_ranges(call: BandCall) -> tuple[torch.Tensor, torch.Tensor]:
    """The visible packed-key range ``[lo, hi)`` of every packed row of ``call`` under flash's rule: the
    inverse of the construction, for checks (a row that sees nothing has ``lo >= hi``)."""
    lo, hi = [], []
    for q0, q1, k0, k1, left, right in segment_ranges(call):
        m, sk = q1 - q0, k1 - k0
        for i in range(m):
            d = i + sk - m
            lo.append(k0 + (0 if left < 0 else min(sk, max(0, d - left))))
            hi.append(k0 + (sk if right < 0 else max(0, min(sk, d + right + 1))))
    return torch.tensor(lo, dtype=torch.int64), torch.tensor(hi, dtype=torch.int64)

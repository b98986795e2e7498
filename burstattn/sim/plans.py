"""The one adapter between the simulator and the library's plans and byte formulas.

Every plan function and byte formula the simulator replays is imported here and nowhere else in
:mod:`burstattn.sim`, so a change of the engine's plan functions changes only this file. The
simulator sees plans as arrays of work per (rank, step), in units of score-matrix entries:

* ``full``: entries of unmasked block ops; ``diag``: entries of causal / strict ops (already
  halved, as :attr:`BlockOp.cost`); ``calls``: kernel calls; ``rows``: query rows merged.

What is exploited (and checked by ``tests/unit/test_sim.py`` against the full replay):

* masks (a causal sliding window, ``burstattn sim --window``): the sparse direct schedule of
  :func:`burstattn.masks.plan.mask_plan` is replayed for every rank (up to 64 ranks);
* ring symmetry: a dense pair's block ops depend on the pair only through its order (``q == k``,
  ``k < q``, ``k > q``), so for ``P > EXACT_P`` the plan is replayed for one representative pair of
  each order instead of all ``P^2`` pairs;
* DistFlashAttn's plan is replayed for every rank up to ``4 * EXACT_P`` ranks and for an evenly
  spread sample of ranks (the edges and the middle included) beyond; the double ring's for every rank
  up to ``EXACT_P`` and for the first and last rank beyond; its transfers are shifts by ``t`` and ``P - t``
  (the plan's ``kv_to`` / ``q_to``), which the link model prices in closed form.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from ..engine.double import double_plan
from ..engine.run import head_groups
from ..engine.schedule import MaskKind, block_ops, distflash_plan, part_rows, ring_plan
from ..masks.plan import mask_bytes, mask_plan
from ..masks.spec import AttnMask
from ..formulas import (accum_dtype, choose_backward, distflash_bytes, double_bytes, element_size, meta_bytes,
                        ring_bytes)
from ..strategies import STRATEGIES
from ..strategies.heads import kv_repeats

EXACT_P = 32

__all__ = ["StepWork", "ring_work", "mask_work", "window_mask", "mask_bytes", "mask_plan", "distflash_work", "double_work", "bytes_formula", "choose_backward",
           "element_size", "accum_dtype", "meta_bytes", "kv_repeats", "ring_bytes", "distflash_bytes", "double_bytes",
           "EXACT_P", "STRATEGY_LAYOUTS", "head_groups"]

STRATEGY_LAYOUTS = {name: (spec.layouts, spec.default_layout) for name, spec in STRATEGIES.items()}


@dataclass(frozen=True)
class StepWork:
    """Work of one pass, ``[ranks, steps]`` float arrays (see the module docstring)."""

    full: np.ndarray
    diag: np.ndarray
    calls: np.ndarray
    rows: np.ndarray

    @property
    def steps(self) -> int:
        return self.full.shape[1]


def _ops_work(ops) -> tuple[float, float, int, int]:
    full = sum(op.cost for op in ops if op.mask is MaskKind.FULL)
    diag = sum(op.cost for op in ops if op.mask is not MaskKind.FULL)
    rows = max((op.q_stop for op in ops), default=0) - min((op.q_start for op in ops), default=0)
    return float(full), float(diag), len(ops), rows


@lru_cache(maxsize=256)
def ring_work(world: int, layout: str, causal: bool, n: int, travelling: str) -> StepWork:
    """Per-rank, per-step work of :func:`~burstattn.engine.schedule.ring_plan` (all ``P`` ranks)."""
    shape = (world, world)
    full, diag, calls, rows = (np.zeros(shape) for _ in range(4))
    if world <= EXACT_P:
        for r in range(world):
            for st in ring_plan(r, world, layout, causal, n, travelling):
                full[r, st.step], diag[r, st.step], calls[r, st.step], rows[r, st.step] = _ops_work(st.ops)
        return StepWork(full, diag, calls, rows)
    # ring symmetry: one representative pair per order (module docstring)
    rep = {0: _ops_work(block_ops(0, 0, world, layout, causal, n)),
           -1: _ops_work(block_ops(1, 0, world, layout, causal, n)),
           1: _ops_work(block_ops(0, 1, world, layout, causal, n))}
    r = np.arange(world)[:, None]
    src = (r - np.arange(world)[None, :]) % world
    q, k = (r, src) if travelling == "kv" else (src, r)
    order = np.sign(k - q)
    for o, w in rep.items():
        sel = order == o
        full[sel], diag[sel], calls[sel], rows[sel] = w
    return StepWork(full, diag, calls, rows)


@lru_cache(maxsize=64)
def distflash_work(world: int, n: int) -> tuple[StepWork, np.ndarray, np.ndarray]:
    """Work of :func:`~burstattn.engine.schedule.distflash_plan` over the replayed ranks, and per
    step whether K/V and queries move (``kv_moves[t]``, ``q_moves[t]``: some replayed rank sends)."""
    ranks = range(world) if world <= 4 * EXACT_P else sorted(
        set(np.linspace(0, world - 1, EXACT_P // 2).astype(int).tolist()) | {world // 2 - 1, world // 2})
    steps = world // 2 + 1
    full, diag, calls, rows = (np.zeros((len(ranks), steps)) for _ in range(4))
    kv_moves, q_moves = np.zeros(steps, bool), np.zeros(steps, bool)
    for i, r in enumerate(ranks):
        for st in distflash_plan(r, world):
            t = st.step
            if st.own_k is not None:
                rr = part_rows(st.own_part, n)
                area = (rr.stop - rr.start) * n
                if st.own_k == r:
                    diag[i, t] += area / 2
                else:
                    full[i, t] += area
                calls[i, t] += 1
                rows[i, t] += rr.stop - rr.start
            if st.helper_q is not None:
                rr = part_rows(st.helper_part, n)
                full[i, t] += (rr.stop - rr.start) * n
                calls[i, t] += 1
            kv_moves[t] |= st.kv_to is not None
            q_moves[t] |= st.q_to is not None
    return StepWork(full, diag, calls, rows), kv_moves, q_moves


@lru_cache(maxsize=64)
def double_work(world: int, ranks_per_node: int, layout: str, causal: bool, n: int,
                travelling: str) -> StepWork:
    """Work of :func:`~burstattn.engine.double.double_plan`, steps flattened outer-major
    (``d * R + s``), for every rank up to ``EXACT_P`` ranks, beyond for the first and the last rank
    (the extremes of the contiguous layout's imbalance; the balanced layouts give every rank the same)."""
    ranks = range(world) if world <= EXACT_P else (0, world - 1)
    full, diag, calls, rows = (np.zeros((len(ranks), world)) for _ in range(4))
    for i, r in enumerate(ranks):
        plan = double_plan(r, world, ranks_per_node, layout, causal, n, travelling)
        for d, inner in enumerate(plan.outer):
            for st in inner:
                j = d * ranks_per_node + st.step
                full[i, j], diag[i, j], calls[i, j], rows[i, j] = _ops_work(st.ops)
    return StepWork(full, diag, calls, rows)


def bytes_formula(strategy: str, *, dtype: torch.dtype, **shape) -> dict:
    """``STRATEGIES[strategy].bytes_formula()(**shape)``: ``{"forward", "backward", "ops"}``."""
    return STRATEGIES[strategy].bytes_formula()(dtype=dtype, **shape)


def window_mask(window: int, block_size: int):
    """A causal sliding window of ``window`` keys (:class:`burstattn.masks.spec.AttnMask`)."""
    return AttnMask(window=(window, 0), block_size=block_size)


@lru_cache(maxsize=32)
def mask_work(window: int, block_size: int, seq_len: int, world: int, layout: str) -> tuple[StepWork, np.ndarray, list]:
    """Work of the masked direct schedule (:func:`burstattn.masks.plan.mask_plan`, ``kv_steps``) of every
    rank under a causal sliding window, ``[ranks, P]`` steps (a step a rank does not take is empty), whether
    some rank moves K/V at step t (``kv_moves[t]``: a shift by t), and each rank's :class:`MaskPlan`.

    A window's pattern depends on ``window / seq_len`` and the layout only, so long sequences are planned
    at a reduced scale (at most 1,024 local tokens, tiles of ``block_size`` scaled alike) and the entries
    scaled back by the square of the factor: the library's plan, not a copy of its logic."""
    n = seq_len // world
    k = 1
    while n // (2 * k) >= 512 and n % (2 * k) == 0 and window % (2 * k) == 0 and block_size % (2 * k) == 0:
        k *= 2
    mask = window_mask(window // k, max(16, block_size // k))
    full, diag, calls, rows = (np.zeros((world, world)) for _ in range(4))
    kv_moves = np.zeros(world, bool)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # thousands of tiny tensor ops: threads only add contention (50x here)
    try:
        mplans = [mask_plan(mask, True, seq_len // k, world, layout, r) for r in range(world)]
    finally:
        torch.set_num_threads(threads)
    for r, mp in enumerate(mplans):
        for st in mp.kv_steps():
            if st.own_k is not None:
                ops = mp.row[st.own_k]
                full[r, st.step] = k * k * sum(op.cost for op in ops if op.mask is MaskKind.FULL)
                diag[r, st.step] = k * k * sum(op.cost for op in ops if op.mask is not MaskKind.FULL)
                calls[r, st.step] = len(ops)
                rows[r, st.step] = n
            kv_moves[st.step] |= st.kv_to is not None and st.step > 0
    return StepWork(full, diag, calls, rows), kv_moves, mplans

"""The one adapter between the simulator and the library's plans and byte formulas.

Every plan function and byte formula the simulator replays is imported here and nowhere else in
:mod:`burstattn.sim`, so a change of the engine's plan functions changes only this file. The
simulator replays the engine's own :class:`~burstattn.engine.plan.Plan` s (from positions, as
:func:`burstattn.engine.run.build_plan` makes them) as arrays of work per (rank, step), in units of
score-matrix entries:

* ``full``: entries of unmasked block ops; ``diag``: entries of causal / strict ops (already
  halved, as :attr:`BlockOp.cost`); ``calls``: kernel calls; ``rows``: query rows merged.

What is exploited (and checked by ``tests/unit/test_sim.py`` against the full replay):

* scale: the dense layouts' block ops scale with the local length (every op boundary is a fixed
  share of the shard), so plans are built at a small local length :func:`plan_len` and the entries
  scaled back by the square of the factor, the rows by the factor;
* masks (a causal sliding window, ``burstattn sim --window``): the sparse direct schedule (the mask's
  summary over positions, :func:`burstattn.masks.plan.mask_plan`) is replayed for every rank (up to 64 ranks), also at a
  reduced scale;
* ring symmetry: a dense pair's block ops depend on the pair only through its order (``q == k``,
  ``k < q``, ``k > q``), so for ``P > EXACT_P`` the plan is replayed for one representative pair of
  each order instead of all ``P^2`` pairs;
* DistFlashAttn's plan is replayed for every rank up to ``4 * EXACT_P`` ranks and for an evenly
  spread sample of ranks (the edges and the middle included) beyond; the double ring's for every rank
  up to ``EXACT_P`` and for the first and last rank beyond; its transfers are shifts by ``t`` and ``P - t``,
  which the link model prices in closed form.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from ..engine.bytes import (accum_dtype, choose_backward, distflash_bytes, double_bytes, element_size, meta_bytes,
                            ring_bytes)
from ..engine.direct import direct, distflash_steps
from ..engine.pairs import MaskKind, ops_from_positions, position_ops
from ..engine.plan import Plan, ring, ring_source, two_level
from ..engine.run import build_plan, head_groups
from ..layouts.named import local_positions
from ..masks.blocks import mask_blocks
from ..masks.plan import mask_bytes, mask_plan
from ..masks.spec import AttnMask
from ..models.head_chunks import head_chunks_problem
from ..strategies import STRATEGIES
from ..strategies.heads import kv_repeats

EXACT_P = 32

__all__ = ["StepWork", "ring_work", "mask_work", "window_mask", "mask_bytes", "mask_plan", "distflash_work",
           "double_work", "bytes_formula", "choose_backward", "element_size", "accum_dtype", "meta_bytes",
           "kv_repeats", "ring_bytes", "distflash_bytes", "double_bytes", "EXACT_P", "STRATEGY_LAYOUTS",
           "head_groups", "plan_len", "head_chunks_problem"]

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


def plan_len(n: int) -> int:
    """The local length plans are built at for a shard of ``n`` tokens: 8, 4 or 2 (the largest that
    divides ``n``; a zigzag shard is even), or ``n`` itself when smaller or odd."""
    return next((m for m in (8, 4, 2) if m <= n and n % m == 0), n)


def _ops_work(ops, f: float) -> tuple[float, float, int, float]:
    """``(full, diag, calls, rows)`` of block ops built at 1/f of the real length."""
    full = sum(op.cost for op in ops if op.mask is MaskKind.FULL)
    diag = sum(op.cost for op in ops if op.mask is not MaskKind.FULL)
    rows = max((op.q_stop for op in ops), default=0) - min((op.q_start for op in ops), default=0)
    return float(full) * f * f, float(diag) * f * f, len(ops), rows * f


def _positions(world: int, layout: str, n: int) -> list:
    return [local_positions(n * world, r, world, layout) for r in range(world)]


def _fill(arrays, i: int, j: int, work) -> None:
    for a, w in zip(arrays, work):
        a[i, j] = w


@lru_cache(maxsize=256)
def ring_work(world: int, layout: str, causal: bool, n: int, travelling: str) -> StepWork:
    """Per-rank, per-step work of the ring plans (:func:`~burstattn.engine.plan.ring`, all ``P`` ranks)."""
    m = plan_len(n)
    f = n / m
    arrays = tuple(np.zeros((world, world)) for _ in range(4))
    if world <= EXACT_P:
        pos = _positions(world, layout, m)
        ops_of = ops_from_positions(pos, pos, causal)
        for r in range(world):
            for st in ring(r, world, ops_of, travelling).steps:
                _fill(arrays, r, st.index, _ops_work(st.pairs[0].ops, f))
        return StepWork(*arrays)
    # ring symmetry: one representative pair per order (module docstring)
    pos = [local_positions(m * world, r, world, layout) for r in (0, 1)]
    rep = {0: _ops_work(position_ops(pos[0], pos[0], causal), f),
           -1: _ops_work(position_ops(pos[1], pos[0], causal), f),
           1: _ops_work(position_ops(pos[0], pos[1], causal), f)}
    r = np.arange(world)[:, None]
    src = ring_source(r, np.arange(world)[None, :], world)
    q, k = (r, src) if travelling == "kv" else (src, r)
    order = np.sign(k - q)
    for o, w in rep.items():
        sel = order == o
        for a, x in zip(arrays, w):
            a[sel] = x
    return StepWork(*arrays)


def _direct_work(plans: list[Plan], ranks, steps: int, f: float) -> tuple[StepWork, np.ndarray, np.ndarray]:
    """Work of direct plans (``plans[i]`` of rank ``ranks[i]``), and per step whether some replayed rank
    receives K/V (``kv_moves[t]``: an own pair with another rank's keys) or helps (``q_moves[t]``)."""
    full, diag, calls, rows = (np.zeros((len(ranks), steps)) for _ in range(4))
    kv_moves, q_moves = np.zeros(steps, bool), np.zeros(steps, bool)
    for i, (r, plan) in enumerate(zip(ranks, plans)):
        for st in plan.steps:
            t = st.index
            for pr in st.pairs:
                if not pr.ops:
                    continue
                w = _ops_work(pr.ops, f)
                full[i, t] += w[0]
                diag[i, t] += w[1]
                calls[i, t] += w[2]
                if pr.q == r:
                    rows[i, t] += w[3]
                    kv_moves[t] |= pr.k != r
                else:
                    q_moves[t] = True
    return StepWork(full, diag, calls, rows), kv_moves, q_moves


@lru_cache(maxsize=64)
def distflash_work(world: int, n: int) -> tuple[StepWork, np.ndarray, np.ndarray]:
    """Work of DistFlashAttn's plans (:func:`~burstattn.engine.direct.distflash_steps`) over the replayed
    ranks, and per step whether K/V and queries move (``kv_moves[t]``, ``q_moves[t]``)."""
    ranks = range(world) if world <= 4 * EXACT_P else sorted(
        set(np.linspace(0, world - 1, EXACT_P // 2).astype(int).tolist()) | {world // 2 - 1, world // 2})
    m = plan_len(n)
    pos = _positions(world, "contiguous", m)
    ops_of = ops_from_positions(pos, pos, True)
    plans = [direct(r, distflash_steps(r, world), world, ops_of, m) for r in ranks]
    return _direct_work(plans, list(ranks), world // 2 + 1, n / m)


@lru_cache(maxsize=64)
def double_work(world: int, ranks_per_node: int, layout: str, causal: bool, n: int,
                travelling: str) -> StepWork:
    """Work of the two-level plans (:func:`~burstattn.engine.plan.two_level`), steps flattened
    outer-major (``d * R + s``), for every rank up to ``EXACT_P`` ranks, beyond for the first and the
    last rank (the extremes of the contiguous layout's imbalance; the balanced layouts give every rank
    the same)."""
    ranks = range(world) if world <= EXACT_P else (0, world - 1)
    m = plan_len(n)
    pos = _positions(world, layout, m)
    ops_of = ops_from_positions(pos, pos, causal)
    arrays = tuple(np.zeros((len(ranks), world)) for _ in range(4))
    for i, r in enumerate(ranks):
        nested = two_level(r, world, ranks_per_node, ops_of, travelling)
        for d, inner in enumerate(nested.inner):
            for st in inner.steps:
                _fill(arrays, i, d * ranks_per_node + st.index, _ops_work(st.pairs[0].ops, n / m))
    return StepWork(*arrays)


def bytes_formula(strategy: str, *, dtype: torch.dtype, **shape) -> dict:
    """``STRATEGIES[strategy].bytes_formula()(**shape)``: ``{"forward", "backward", "ops"}``."""
    return STRATEGIES[strategy].bytes_formula()(dtype=dtype, **shape)


def window_mask(window: int, block_size: int):
    """A causal sliding window of ``window`` keys (:class:`burstattn.masks.spec.AttnMask`)."""
    return AttnMask(window=(window, 0), block_size=block_size)


@lru_cache(maxsize=32)
def mask_work(window: int, block_size: int, seq_len: int, world: int, layout: str) -> tuple[StepWork, np.ndarray, list]:
    """Work of the masked direct plans (:func:`~burstattn.engine.run.build_plan` with the mask's summary
    on schedule ``"sparse"``, the forward's) of every rank under a causal sliding window,
    ``[ranks, P]`` steps (a step a rank does not take is empty), whether some rank moves K/V at step t
    (``kv_moves[t]``: a shift by t), and each rank's :class:`MaskPlan`.

    A window's pattern depends on ``window / seq_len`` and the layout only, so long sequences are planned
    at a reduced scale (at most 1,024 local tokens, tiles of ``block_size`` scaled alike) and the entries
    scaled back by the square of the factor: the library's plan, not a copy of its logic."""
    n = seq_len // world
    k = 1
    while n // (2 * k) >= 512 and n % (2 * k) == 0 and window % (2 * k) == 0 and block_size % (2 * k) == 0:
        k *= 2
    mask = window_mask(window // k, max(16, block_size // k))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # thousands of tiny tensor ops: threads only add contention (50x here)
    try:
        mplans = [mask_plan(mask, True, seq_len // k, world, layout, r) for r in range(world)]
        pos = _positions(world, layout, n // k)
        plans = [build_plan(r, world, positions=pos, causal=True, travelling="kv", schedule="sparse",
                            blocks=mask_blocks(mask, seq_len // k)) for r in range(world)]
    finally:
        torch.set_num_threads(threads)
    work, kv_moves, _ = _direct_work(plans, list(range(world)), world, k)
    kv_moves[0] = False
    return work, kv_moves, mplans

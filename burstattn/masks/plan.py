"""Masked calls' plans: a mask's block summary over positions, its sparse direct schedule, byte formula
and balance figure (pure).

A masked call plans like every dense one, from positions (:func:`burstattn.engine.run.make_plan`): the
per-rank query and key positions (a layout name only produces them) and the mask's block summary
(:class:`~.blocks.MaskBlocks`, the producer of block ops in place of the dense
:func:`~burstattn.engine.pairs.position_ops`) give the pairs' ops, and the sparse direct schedule
(:func:`burstattn.engine.direct.sparse_steps`, schedule ``"sparse"``) is derived from the non-empty
pairs: rank r needs the K/V of rank s only if some query of r sees some key of s (``need(r, s)``),
and K/V go straight from their owner to the ranks that need them instead of around the ring.
:class:`MaskPlan` is one rank's row and column of those pairs, for the byte formula.

Backward, like the ring's two backwards:

* ``"kv"``: K/V go again to the ranks that need them; each returns its float32 dK/dV partial to
  the owner (op ``ret_kv``).
* ``"burst"``: the queries travel instead (at step t from rank ``r + t`` to rank ``r``): rank r
  sends Q, dO, LSE and D to every rank whose keys it sees (op ``q``); that rank returns the
  float32 dQ partial (op ``ret_q``).

Bytes each rank sends (``e``, ``a``: element sizes of the input and accumulator dtypes;
``kv = 2*B*n*Hkv*d``, ``rows = B*n*Hq``; ``readers(r)`` = ranks s != r with need(s, r),
``sources(r)`` = ranks s != r with need(r, s)):

* forward: ``|readers| * kv * e`` (op ``kv``) plus the 16-int validation (op ``meta``)
* backward ``"kv"``: ``|readers| * kv * e`` (op ``kv``) + ``|sources| * kv * a`` (op ``ret_kv``)
* backward ``"burst"``: ``|sources| * rows * ((d + d_v)*e + 2*a)`` (op ``q``) + ``|readers| * rows * d * a``
  (op ``ret_q``)

(``kv = B*n_k*Hkv*(d + d_v)`` when the key shard has its own length ``n_k`` or V its own head size
``d_v``.)

Dense (every pair needed) this equals the ring's bytes except for the accumulator's last hop home.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..engine.bytes import META_INTS, accum_dtype, byte_totals, element_size
from ..engine.direct import DirectStep, sparse_steps
from ..engine.pairs import BlockOp, ops_from_positions
from ..layouts.named import local_positions
from .blocks import MaskBlocks, layout_key, mask_blocks
from .spec import AttnMask


@dataclass(frozen=True)
class MaskPlan:
    """What ``rank`` computes and exchanges under a mask (from positions: :func:`mask_plan`).

    Attributes:
        row: ops of this rank's queries against each rank's keys (index = key rank).
        col: ops of each rank's queries against this rank's keys (index = query rank).
        blocks: the producer they came from (the mask's summary over the call's lengths), which the
            engine's plans of the call use (:func:`burstattn.engine.run.build_plan`).
    """

    rank: int
    world_size: int
    row: tuple[tuple[BlockOp, ...], ...]
    col: tuple[tuple[BlockOp, ...], ...]
    blocks: Optional[MaskBlocks] = None

    @property
    def sources(self) -> tuple[int, ...]:
        """Other ranks whose K/V this rank's queries see."""
        return tuple(s for s in range(self.world_size) if s != self.rank and self.row[s])

    @property
    def readers(self) -> tuple[int, ...]:
        """Other ranks whose queries see this rank's K/V."""
        return tuple(s for s in range(self.world_size) if s != self.rank and self.col[s])

    def ops_of(self, q: int, k: int) -> tuple[BlockOp, ...]:
        """The ops of the pair (``q``, ``k``) in this rank's row or column."""
        return self.row[k] if q == self.rank else self.col[q]

    def kv_steps(self) -> tuple[DirectStep, ...]:
        """Forward / ``"kv"``-backward plan: K/V come from ``r-t`` and go to ``r+t``."""
        return sparse_steps(self.rank, self.world_size, self.ops_of, "kv")

    def q_steps(self) -> tuple[DirectStep, ...]:
        """``"burst"``-backward plan: this rank's queries go to ``r-t`` (whose keys they see) and
        the queries of ``r+t`` come to meet this rank's keys."""
        return sparse_steps(self.rank, self.world_size, self.ops_of, "q")


def mask_plan(mask: AttnMask, causal: bool, seq_len: int, world_size: int, layout, rank: int,
              k_len: Optional[int] = None, kv_layout=None) -> MaskPlan:
    """The :class:`MaskPlan` of ``rank``: ``seq_len`` queries in ``layout``, ``k_len`` keys (default as
    many) in ``kv_layout`` (default ``layout``). The layouts give every rank's positions; the pairs' ops
    come from them by the mask's summary (:class:`~.blocks.MaskBlocks`, cached in ``mask``), as the
    engine's plans take them (:func:`~burstattn.engine.pairs.ops_from_positions`). Kept in ``mask`` by
    these arguments (the layouts by :func:`~.blocks.layout_key`)."""
    k_len = seq_len if k_len is None else k_len
    kv_layout = layout if kv_layout is None else kv_layout
    key = ("plan", bool(causal), seq_len, world_size, layout_key(layout), rank, k_len, layout_key(kv_layout))
    plan = mask.cache.get(key)
    if plan is None:  # every call of a shape asks again (its cross-rank check): the positions once per shape
        q_pos = [local_positions(seq_len, r, world_size, layout) for r in range(world_size)]
        k_pos = [local_positions(k_len, r, world_size, kv_layout) for r in range(world_size)]
        blocks = mask_blocks(mask, seq_len, k_len)
        ops_of = ops_from_positions(q_pos, k_pos, causal, blocks)
        row = tuple(ops_of(rank, s) for s in range(world_size))
        col = tuple(ops_of(s, rank) for s in range(world_size))
        plan = mask.cache[key] = MaskPlan(rank, world_size, row, col, blocks)
    return plan


def mask_bytes(plan: MaskPlan, *, batch: int, local_seq: int, q_heads: int, kv_heads: int, head_dim: int,
               dtype: torch.dtype, backward: str, kv_local_seq: Optional[int] = None,
               v_head_dim: Optional[int] = None) -> dict:
    """Bytes ``plan.rank`` sends per call (module docstring): ``{"forward", "backward", "ops"}``.
    ``kv_local_seq`` / ``v_head_dim``: the key shard's length and V's head size (default: the
    queries' length, ``head_dim``); K and V travel at their own sizes, ``kv = B*n_k*Hkv*(d + d_v)``."""
    e, a = element_size(dtype), element_size(accum_dtype(dtype))
    nk = local_seq if kv_local_seq is None else kv_local_seq
    dv = head_dim if v_head_dim is None else v_head_dim
    kv = batch * nk * kv_heads * (head_dim + dv)
    rows = batch * local_seq * q_heads
    readers, sources = len(plan.readers), len(plan.sources)
    ops = {("forward", "kv"): readers * kv * e, ("forward", "meta"): (plan.world_size - 1) * META_INTS * 8}
    if backward == "kv":
        ops.update({("backward", "kv"): readers * kv * e, ("backward", "ret_kv"): sources * kv * a})
    elif backward == "burst":
        ops.update({("backward", "q"): sources * rows * ((head_dim + dv) * e + 2 * a),
                    ("backward", "ret_q"): readers * rows * head_dim * a})
    else:
        raise ValueError(f"backward must be 'burst' or 'kv', got {backward!r}")
    return byte_totals(ops)


def choose_mask_backward(*, batch: int, local_seq: int, q_heads: int, kv_heads: int, head_dim: int,
                         dtype: torch.dtype, kv_local_seq: Optional[int] = None,
                         v_head_dim: Optional[int] = None) -> str:
    """``"burst"`` or ``"kv"``: the backward with fewer bytes summed over all ranks (ties: burst).

    Every needed off-diagonal pair is one source of one rank and one reader of another, so the
    sums are ``pairs * rows*((d + d_v)*e + 2*a + d*a)`` against ``pairs * kv*(e + a)``: the choice
    does not depend on the mask, and every rank makes the same one without communicating.
    """
    e, a = element_size(dtype), element_size(accum_dtype(dtype))
    nk = local_seq if kv_local_seq is None else kv_local_seq
    dv = head_dim if v_head_dim is None else v_head_dim
    rows = batch * local_seq * q_heads
    kv = batch * nk * kv_heads * (head_dim + dv)
    return "burst" if rows * ((head_dim + dv) * e + 2 * a + head_dim * a) <= kv * (e + a) else "kv"


def rank_work(mask: AttnMask, causal: bool, seq_len: int, world_size: int, layout) -> list[float]:
    """Score entries each rank computes in the forward (its row of pair ops; the attention FLOPs
    up to a constant). ``max / mean`` of this is the balance figure."""
    pos = [local_positions(seq_len, r, world_size, layout) for r in range(world_size)]
    ops_of = ops_from_positions(pos, pos, causal, mask_blocks(mask, seq_len))
    return [sum(op.cost for s in range(world_size) for op in ops_of(r, s)) for r in range(world_size)]

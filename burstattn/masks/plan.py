"""Sparse direct schedules for masked attention, their byte formula and balance figure (pure).

With a mask, rank r needs the K/V of rank s only if some query of r sees some key of s
(``need(r, s)``: the pair's block ops are not empty, :func:`~.blocks.pair_ops`). Instead of
relaying every block around the ring, K/V go straight from their owner to the ranks that need
them, at step ``t`` from rank ``r - t`` to rank ``r`` (mod P), for ``t = 1 .. P-1``; a step at
which rank r neither receives nor sends is dropped from r's plan, so a sliding window over the
contiguous layout takes 2 steps instead of P and documents that sit inside one rank take 1.
Each rank only needs its own row (who it reads) and column (who reads it) of ``need``: no
collective, and both ends of every transfer derive it from the same pure function.

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

from ..engine.direct import DirectStep
from ..engine.pairs import BlockOp
from ..engine.plan import ring_source
from ..formulas import META_INTS, accum_dtype, byte_totals, element_size
from .blocks import pair_ops
from .spec import AttnMask


@dataclass(frozen=True)
class MaskPlan:
    """What ``rank`` computes and exchanges under a mask.

    Attributes:
        row: ops of this rank's queries against each rank's keys (index = key rank).
        col: ops of each rank's queries against this rank's keys (index = query rank).
    """

    rank: int
    world_size: int
    row: tuple[tuple[BlockOp, ...], ...]
    col: tuple[tuple[BlockOp, ...], ...]

    @property
    def sources(self) -> tuple[int, ...]:
        """Other ranks whose K/V this rank's queries see."""
        return tuple(s for s in range(self.world_size) if s != self.rank and self.row[s])

    @property
    def readers(self) -> tuple[int, ...]:
        """Other ranks whose queries see this rank's K/V."""
        return tuple(s for s in range(self.world_size) if s != self.rank and self.col[s])

    def kv_steps(self) -> tuple[DirectStep, ...]:
        """Forward / ``"kv"``-backward plan: K/V come from ``r-t`` and go to ``r+t``."""
        r, p = self.rank, self.world_size
        steps = [DirectStep(0, r if self.row[r] else None, None, None, None)]
        for t in range(1, p):
            src, dst = ring_source(r, t, p), (r + t) % p
            own_k = src if self.row[src] else None
            kv_to = dst if self.col[dst] else None
            if own_k is not None or kv_to is not None:
                steps.append(DirectStep(t, own_k, None, kv_to, None))
        return tuple(steps)

    def q_steps(self) -> tuple[DirectStep, ...]:
        """``"burst"``-backward plan: this rank's queries go to ``r-t`` (whose keys they see) and
        the queries of ``r+t`` come to meet this rank's keys."""
        r, p = self.rank, self.world_size
        steps = [DirectStep(0, r if self.row[r] else None, None, None, None)]
        for t in range(1, p):
            src, dst = (r + t) % p, ring_source(r, t, p)
            helper_q = src if self.col[src] else None
            q_to = dst if self.row[dst] else None
            if helper_q is not None or q_to is not None:
                steps.append(DirectStep(t, None, helper_q, None, q_to))
        return tuple(steps)


def mask_plan(mask: AttnMask, causal: bool, seq_len: int, world_size: int, layout, rank: int,
              k_len: Optional[int] = None, kv_layout=None) -> MaskPlan:
    """The :class:`MaskPlan` of ``rank`` (its row and column of pair ops; cached in ``mask``):
    ``seq_len`` queries in ``layout``, ``k_len`` keys (default as many) in ``kv_layout``."""
    args = (mask, causal, seq_len, world_size, layout)
    row = tuple(pair_ops(*args, rank, s, k_len, kv_layout) for s in range(world_size))
    col = tuple(pair_ops(*args, s, rank, k_len, kv_layout) for s in range(world_size))
    return MaskPlan(rank, world_size, row, col)


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
    return [sum(op.cost for s in range(world_size)
                for op in pair_ops(mask, causal, seq_len, world_size, layout, r, s))
            for r in range(world_size)]


"""Per-call setup shared by ``burst_attn_func`` and the strategies: build the mask and this rank's
plan *before* the cross-rank input check, so that a bad mask (or a ``mask_mod`` that raises)
becomes a problem that the check reports on every rank instead of an exception on one
(:func:`build_mask`, :func:`plan_for`; the strategies' ``check_call``)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from ..comm.agree import agree
from ..comm.host import LruCache
from .plan import MaskPlan, mask_plan
from .spec import AttnMask, MaskKeywords

if TYPE_CHECKING:  # a type only: the call layer sits above the masks
    from ..call.call import Call

Problem = Optional[tuple[type, str]]


def build_mask(keywords: MaskKeywords) -> tuple[Optional[AttnMask], Problem]:
    """The mask of ``keywords`` (a :class:`~.spec.MaskKeywords`, or anything holding its fields: a call's
    keywords), its ``ValueError`` returned as a problem instead of raised; the ``max_seqlen`` keywords
    checked against its documents (:meth:`~.spec.MaskKeywords.seqlen_problem`)."""
    try:
        built = MaskKeywords.build(keywords)
    except ValueError as e:
        return None, (ValueError, str(e))
    return built, MaskKeywords.seqlen_problem(keywords, built)


def plan_for(q, cfg: Call, rank: int, world_size: int,
             k_local: Optional[int] = None) -> tuple[Optional[MaskPlan], Problem]:
    """This rank's :class:`~.plan.MaskPlan` for a sparse call (``None`` for a dense one), or the
    problem that prevents it (the sequence length the mask does not fit, a partition for another
    world size, a ``mask_mod`` that raises or returns a non-bool). ``k_local``: the key shard's
    length (default the queries')."""
    if not cfg.sparse:
        return None, None
    seq_len = q.shape[1] * world_size
    k_len = seq_len if k_local is None else k_local * world_size
    for arg, layout, length in (("layout", cfg.layout, seq_len), ("kv_layout", cfg.keys_layout, k_len)):
        if not isinstance(layout, str) and (layout.world_size, layout.seq_len) != (world_size, length):
            return None, (ValueError, f"{arg}: the partition is for {layout.world_size} ranks and "
                                      f"{layout.seq_len} tokens, but this call has {world_size} ranks and "
                                      f"{length} tokens")
    mask = effective_mask(cfg)
    problem = mask.problem(seq_len, k_len)
    if problem:
        return None, (ValueError, problem)
    try:
        return mask_plan(mask, cfg.causal, seq_len, world_size, cfg.layout, rank, k_len, cfg.keys_layout), None
    except ValueError as e:
        return None, (ValueError, str(e))


def topology_problem(cfg: Call, world_size: int) -> Problem:
    """Why ``cfg.topology`` does not fit a group of ``world_size`` ranks, or ``None``."""
    topo = cfg.topology
    if hasattr(topo, "nodes") and topo.nodes * topo.ranks_per_node != world_size:
        return (ValueError, f"topology has {topo.nodes} nodes x {topo.ranks_per_node} ranks, but the group has "
                            f"{world_size} ranks")
    return None


class GuardedMaskMod:
    """A ``mask_mod`` that never raises inside the ring: a rank whose predicate raises (or returns a
    non-bool) in the middle of a pass would leave its peers waiting for transfers that never come.
    The guard records the first failure and answers "nothing visible" for that block, so the pass
    runs to its end on every rank; :func:`raise_mask_failures` then raises on all of them."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.failure: Optional[str] = None

    def __call__(self, q_pos, k_pos):
        try:
            res = self.fn(q_pos, k_pos)
            if isinstance(res, torch.Tensor) and res.dtype == torch.bool:
                return res.expand(q_pos.shape[0], k_pos.shape[-1])
            problem = (f"mask_mod must return a bool tensor, got "
                       f"{res.dtype if isinstance(res, torch.Tensor) else type(res).__name__}")
        except Exception as e:  # a user predicate may raise anything: report it on every rank
            problem = f"mask_mod raised {type(e).__name__}: {e}"
        if self.failure is None:
            self.failure = problem
        return torch.zeros(q_pos.shape[0], k_pos.shape[-1], dtype=torch.bool)


def raise_mask_failures(guard: Optional[GuardedMaskMod], ring) -> None:
    """After a masked pass with a ``mask_mod``: if the predicate failed on any rank of ``ring``'s group,
    raise the same ``ValueError`` on every rank naming the problem and the ranks
    (:func:`burstattn.comm.agree.agree`: one 8-byte all-gather). Nothing is exchanged without a ``mask_mod``."""
    if guard is None:
        return
    agree("during the attention pass", (), ring.group, problem=guard.failure)


def _definition(window, bounds: Optional[torch.Tensor], block_size: int, kv_bounds: Optional[torch.Tensor]):
    """The key of a data mask's definition (window, document bounds, tile size)."""
    return (None if window is None else tuple(window), None if bounds is None else bounds.cpu().numpy().tobytes(),
            block_size, None if kv_bounds is None else kv_bounds.cpu().numpy().tobytes())


def data_mask(window, bounds: Optional[torch.Tensor], block_size: int,
              kv_bounds: Optional[torch.Tensor] = None) -> AttnMask:
    """The mask made from data (window, document bounds, tile size; no ``mask_mod``), the same object for
    the same definition (:data:`DATA_MASKS`): the custom op receives a mask as data and looks its
    :class:`~.spec.AttnMask` up here: the user's own when :func:`register_mask` saw it (so its block
    summaries, which cost seconds at long sequences, are built once, and in the object the user keeps)."""
    key = _definition(window, bounds, block_size, kv_bounds)
    return DATA_MASKS.get(key, lambda: AttnMask(window=key[0], cu_seqlens=None if bounds is None else bounds.cpu(),
                                                block_size=block_size,
                                                cu_seqlens_k=None if kv_bounds is None else kv_bounds.cpu()))


def register_mask(mask: AttnMask) -> AttnMask:
    """Make ``mask`` (no ``mask_mod``) the object :func:`data_mask` gives for its definition, unless one is
    registered already (then that one, whose summaries are built already, keeps serving it)."""
    return DATA_MASKS.get(_definition(mask.window, mask.bounds, mask.block_size, mask.kv_bounds), lambda: mask)


def effective_mask(cfg: Call) -> AttnMask:
    """The call's mask; when only an explicit partition makes the call sparse, the one empty mask of
    :func:`data_mask` (so its block summaries are cached too)."""
    return cfg.mask if cfg.mask is not None else data_mask(None, None, AttnMask.block_size)


# The process-wide memo of data masks (see data_mask): block summaries of a mask outlive one call.
DATA_MASKS = LruCache(32)

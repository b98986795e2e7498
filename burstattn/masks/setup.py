"""Per-call setup shared by ``burst_attn_func`` and the strategies: build the mask and this rank's
plan *before* the cross-rank input check, so that a bad mask (or a ``mask_mod`` that raises)
becomes a problem that the check reports on every rank instead of an exception on one
(:func:`checked_config`)."""
from __future__ import annotations

from typing import Optional

from ..config import AttnConfig
from ..validate import check_inputs, local_problem
from .plan import MaskPlan, mask_plan
from .spec import AttnMask, make_mask

Problem = Optional[tuple[type, str]]


def build_mask(window=None, cu_seqlens=None, document_ids=None, mask_mod=None,
               mask=None) -> tuple[Optional[AttnMask], Problem]:
    """:func:`~.spec.make_mask`, its ``ValueError`` returned as a problem instead of raised."""
    try:
        return make_mask(window, cu_seqlens, document_ids, mask_mod, mask), None
    except ValueError as e:
        return None, (ValueError, str(e))


def effective_mask(cfg: AttnConfig) -> AttnMask:
    """The call's mask; an empty one when only an explicit partition makes the call sparse."""
    return cfg.mask if cfg.mask is not None else AttnMask()


def plan_for(q, cfg: AttnConfig, rank: int, world_size: int) -> tuple[Optional[MaskPlan], Problem]:
    """This rank's :class:`~.plan.MaskPlan` for a sparse call (``None`` for a dense one), or the
    problem that prevents it (the sequence length the mask does not fit, a partition for another
    world size, a ``mask_mod`` that raises or returns a non-bool)."""
    if not cfg.sparse:
        return None, None
    seq_len = q.shape[1] * world_size
    if not isinstance(cfg.layout, str) and (cfg.layout.world_size, cfg.layout.seq_len) != (world_size, seq_len):
        return None, (ValueError, f"layout: the partition is for {cfg.layout.world_size} ranks and "
                                  f"{cfg.layout.seq_len} tokens, but this call has {world_size} ranks and "
                                  f"{seq_len} tokens")
    mask = effective_mask(cfg)
    problem = mask.problem(seq_len)
    if problem:
        return None, (ValueError, problem)
    try:
        return mask_plan(mask, cfg.causal, seq_len, world_size, cfg.layout, rank), None
    except ValueError as e:
        return None, (ValueError, str(e))


def checked_config(q, k, v, ring, mask_args: dict, fn: str, **cfg_args) -> tuple[AttnConfig, Optional[MaskPlan]]:
    """The call's :class:`~burstattn.config.AttnConfig` (``cfg_args`` plus the mask built from
    ``mask_args``) and this rank's mask plan (``None`` for a dense call), after
    :func:`~burstattn.validate.check_inputs` has passed on every rank of ``ring``'s group: a bad
    input, mask or topology on any rank raises on all of them."""
    amask, problem = build_mask(**mask_args)
    cfg = AttnConfig(mask=amask, **cfg_args)
    plan = None
    if problem is None and local_problem(q, k, v, cfg) is None:
        plan, problem = plan_for(q, cfg, ring.rank, ring.world_size)
    topo = cfg.topology
    if problem is None and hasattr(topo, "nodes") and topo.nodes * topo.ranks_per_node != ring.world_size:
        problem = (ValueError, f"topology has {topo.nodes} nodes x {topo.ranks_per_node} ranks, but the group has "
                               f"{ring.world_size} ranks")
    check_inputs(q, k, v, cfg, ring.group, ring.world_size, fn=fn, extra=problem)
    return cfg, plan

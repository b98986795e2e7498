"""Per-call setup shared by ``burst_attn_func`` and the strategies: build the mask and this rank's
plan *before* the cross-rank input check, so that a bad mask (or a ``mask_mod`` that raises)
becomes a problem that the check reports on every rank instead of an exception on one
(:func:`checked_config`)."""
from __future__ import annotations

from typing import Optional

import torch

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


def topology_problem(cfg: AttnConfig, world_size: int) -> Problem:
    """Why ``cfg.topology`` does not fit a group of ``world_size`` ranks, or ``None``."""
    topo = cfg.topology
    if hasattr(topo, "nodes") and topo.nodes * topo.ranks_per_node != world_size:
        return (ValueError, f"topology has {topo.nodes} nodes x {topo.ranks_per_node} ranks, but the group has "
                            f"{world_size} ranks")
    return None


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
    problem = problem or topology_problem(cfg, ring.world_size)
    check_inputs(q, k, v, cfg, ring.group, ring.world_size, fn=fn, extra=problem)
    return cfg, plan


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
    """After a masked pass with a ``mask_mod``: one all-reduce of a failure flag over ``ring``'s
    group; if the predicate failed on any rank, raise ``ValueError`` on every rank naming the ranks
    and the problem. Nothing is exchanged without a ``mask_mod``."""
    if guard is None:
        return
    if ring.world_size == 1:
        if guard.failure:
            raise ValueError(f"during the attention pass: {guard.failure}")
        return
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(ring.group) == "nccl" else "cpu"
    flag = torch.tensor([int(guard.failure is not None)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=ring.group)
    if int(flag.item()):
        texts = [None] * ring.world_size
        dist.all_gather_object(texts, guard.failure, group=ring.group)
        detail = "; ".join(f"rank {r}: {t}" for r, t in enumerate(texts) if t)
        raise ValueError(f"during the attention pass the mask_mod failed, all ranks abort the call ({detail})")


class MaskCache:
    """Masks made from data (window, document bounds, tile size; no ``mask_mod``) kept by their
    definition, so that their block summaries, which cost seconds at long sequences, are built once:
    the custom op receives a mask as data and looks its :class:`~.spec.AttnMask` up here. Bounded
    (least recently used entries go first); a pure memo, so sharing it is safe."""

    def __init__(self, size: int = 32) -> None:
        from collections import OrderedDict

        self.size = size
        self.entries: "OrderedDict[tuple, AttnMask]" = OrderedDict()

    def get(self, window, bounds: Optional[torch.Tensor], block_size: int) -> AttnMask:
        """The cached mask of this definition (made on first use)."""
        key = (None if window is None else tuple(window),
               None if bounds is None else bounds.cpu().numpy().tobytes(), block_size)
        mask = self.entries.get(key)
        if mask is None:
            mask = AttnMask(window=key[0], cu_seqlens=None if bounds is None else bounds.cpu(), block_size=block_size)
            self.entries[key] = mask
            while len(self.entries) > self.size:
                self.entries.popitem(last=False)
        self.entries.move_to_end(key)
        return mask


# The process-wide memo of data masks (see MaskCache): block summaries of a mask outlive one call.
DATA_MASKS = MaskCache()

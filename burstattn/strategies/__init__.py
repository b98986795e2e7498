"""Every way of distributing attention behind one entry point, :func:`attention`.

Strategies share the communication (:mod:`burstattn.comm`), the local kernels
(:mod:`burstattn.kernels`) and the merge/schedules (:mod:`burstattn.engine`); each lives in
its own small module.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Optional

import torch
import torch.distributed as dist

from ..config import LAYOUTS
from ..layouts.named import DEFAULT_LAYOUT, layout_or_default  # layout=None means this for every strategy, as for shard_sequence
from .base import MASK_OPTIONS, MODEL_OPTIONS, StrategySpec

_ALL = LAYOUTS
STRATEGIES = MappingProxyType({s.name: s for s in (
    # BurstAttention: K/V ring forward, query-ring (or K/V-ring) backward, balanced layouts; masks skip work
    StrategySpec("burst", _ALL, DEFAULT_LAYOUT,
                 ("backend", "backward", "schedule", "topology") + MASK_OPTIONS + MODEL_OPTIONS, partitions=True),
    # RingAttention: K/V ring, K/V/dK/dV backward ring (the paper's layout is contiguous; every layout is exact)
    StrategySpec("ring", _ALL, DEFAULT_LAYOUT, ("backend",) + MASK_OPTIONS + MODEL_OPTIONS, partitions=True),
    # Ring Self-Attention: a K ring builds the full local_seq x seq scores (kept: O(n N) memory), a V ring
    StrategySpec("rsa", _ALL, DEFAULT_LAYOUT, ("backend",)),
    # DeepSpeed-Ulysses: all-to-all sequence shards <-> head shards
    StrategySpec("ulysses", _ALL, DEFAULT_LAYOUT, ("backend",) + MASK_OPTIONS, partitions=True),
    # all-gather K/V, local attention, reduce-scatter dK/dV (Llama 3 CP)
    StrategySpec("allgather", _ALL, DEFAULT_LAYOUT, ("backend", "grad_partials") + MASK_OPTIONS, partitions=True),
    # USP: Ulysses inside a group x burst ring across groups
    StrategySpec("usp", _ALL, DEFAULT_LAYOUT, ("backend", "backward", "ulysses_degree", "ring_degree", "mesh",
                                               "ulysses_group", "ring_group", "grad_partials"), partitions=True),
    # Megatron-SP tensor parallelism: all-gather q/k/v, Hq/P heads over the full sequence, all-to-all back
    StrategySpec("tp", _ALL, DEFAULT_LAYOUT, ("backend",), partitions=True),
)})


def _registry_problem(spec, strategy: str, layout, options: dict):
    """What is wrong with the strategy name, layout or options on this rank, or ``None``."""
    if spec is None:
        return ValueError, f"strategy must be one of {sorted(STRATEGIES)}, got {strategy!r}"
    unknown = sorted(set(options) - set(spec.options))
    if unknown:
        takers = [s.name for s in STRATEGIES.values() if set(unknown) <= set(s.options)]
        hint = f"; strategies that take {unknown}: {takers}" if takers else ""
        return ValueError, (f"strategy {strategy!r} does not take option(s) {unknown}; it takes "
                            f"{list(spec.options)}{hint}")
    if layout is not None and not isinstance(layout, str):
        if not spec.partitions:
            return ValueError, (f"strategy {strategy!r} takes layout names {list(spec.layouts)}, not a "
                                f"{type(layout).__name__}")
    elif layout is not None and layout not in spec.layouts:
        return ValueError, f"strategy {strategy!r} supports layout(s) {list(spec.layouts)}, got {layout!r}"
    return None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, strategy: str = "burst",
              group: Optional[dist.ProcessGroup] = None, causal: bool = False,
              softmax_scale: Optional[float] = None, layout: Optional[str] = None,
              **strategy_options) -> torch.Tensor:
    """Exact attention over sequence shards with the chosen ``strategy``.

    Same conventions as :func:`burstattn.burst_attn_func`: ``q [B, n, Hq, D]``,
    ``k, v [B, n, Hkv, D]``, this rank's shard in ``layout`` exactly as
    :func:`burstattn.shard_sequence` gives it (one meaning for every strategy; ``None``: ``"zigzag"``,
    shard_sequence's default), output ``[B, n, Hq, D]`` in q's dtype, differentiable.

    Raises:
        ValueError: unknown strategy, a layout the strategy does not support, or an option
            it does not take (names what it takes), on every rank of the group.
    """
    spec = STRATEGIES.get(strategy)
    problem = _registry_problem(spec, strategy, layout, strategy_options)
    if problem is not None:
        # raise on every rank: the ranks without this problem meet this check inside their
        # strategy (every strategy's first collective is the same input check)
        from ..call.prepare import label, refuse
        refuse(label(strategy), problem, group)
    layout = layout_or_default(layout)
    return MODULES[spec.name].run(q, k, v, group=group, causal=causal, softmax_scale=softmax_scale,
                                  layout=layout, **strategy_options)


# imported with the package (not on first use) so that attention() is traceable by torch.compile
from . import allgather, burst, ring, rsa, tp, ulysses, usp  # noqa: E402

MODULES = MappingProxyType({m.__name__.rsplit(".", 1)[1]: m for m in (allgather, burst, ring, rsa, tp, ulysses, usp)})

__all__ = ["attention", "STRATEGIES", "StrategySpec"]

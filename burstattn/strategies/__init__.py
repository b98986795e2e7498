"""Every way of distributing attention behind one entry point, :func:`attention`.

Strategies share the communication (:mod:`burstattn.comm`), the local kernels
(:mod:`burstattn.kernels`) and the merge/schedules (:mod:`burstattn.engine`); each lives in
its own small module.
"""
from __future__ import annotations

from types import MappingProxyType

import torch

from ..call.options import GROUPS, KEYWORDS, SPELLINGS, BurstOptions, is_default, keywords_of, names_in
from ..call.prepare import label, refuse
from ..config import LAYOUTS
from ..layouts.named import DEFAULT_LAYOUT  # layout=None means this for every strategy, as for shard_sequence
from .base import StrategySpec

_ALL = LAYOUTS
KERNEL = names_in("kernel")
ONE_SEQUENCE_MASKS = names_in("mask", keys=False)  # strategies that gather one sequence: no keys' own documents
FLOAT32_PARTIALS = (("grad_partials", "float32"),)
STRATEGIES = MappingProxyType({s.name: s for s in (
    # BurstAttention: K/V ring forward, query-ring (or K/V-ring) backward, balanced layouts; masks skip work.
    # Every keyword of burst_attn_func.
    StrategySpec("burst", _ALL, DEFAULT_LAYOUT, names_in("kernel", "schedule", "mask", "model"), partitions=True),
    # RingAttention: K/V ring, K/V/dK/dV backward ring (the paper's layout is contiguous; every layout is exact)
    StrategySpec("ring", _ALL, DEFAULT_LAYOUT, names_in("kernel", "mask", "model"), partitions=True),
    # Ring Self-Attention: a K ring builds the full local_seq x seq scores (kept: O(n N) memory), a V ring
    StrategySpec("rsa", _ALL, DEFAULT_LAYOUT, KERNEL),
    # DeepSpeed-Ulysses: all-to-all sequence shards <-> head shards
    StrategySpec("ulysses", _ALL, DEFAULT_LAYOUT, KERNEL + ONE_SEQUENCE_MASKS, partitions=True),
    # all-gather K/V, local attention, reduce-scatter dK/dV (Llama 3 CP)
    StrategySpec("allgather", _ALL, DEFAULT_LAYOUT, KERNEL + ONE_SEQUENCE_MASKS + ("grad_partials",), partitions=True,
                 defaults=FLOAT32_PARTIALS),
    # USP: Ulysses inside a group x burst ring across groups
    StrategySpec("usp", _ALL, DEFAULT_LAYOUT, KERNEL + ("backward", "grad_partials", "ulysses_degree", "ring_degree",
                                                         "mesh", "ulysses_group", "ring_group"), partitions=True,
                 defaults=FLOAT32_PARTIALS),
    # Megatron-SP tensor parallelism: all-gather q/k/v, Hq/P heads over the full sequence, all-to-all back
    StrategySpec("tp", _ALL, DEFAULT_LAYOUT, KERNEL, partitions=True),
)})
VOCABULARY = frozenset(KEYWORDS) | frozenset(SPELLINGS) | {"options"}
"""What ``attention`` reads as a keyword of :class:`~burstattn.call.options.Keywords` (any other keyword is a
strategy's own option, as usp's degrees)."""


def _asked(keywords: dict) -> dict:
    """The keywords a call asks something with (by the name it was given: ``window_size=`` stays so), the
    fields of an ``options=BurstOptions(...)`` included; a keyword at its default asks nothing."""
    asked = {}
    for name, value in keywords.items():
        if name == "options" and isinstance(value, BurstOptions):
            asked.update((n, getattr(value, n)) for n in KEYWORDS if hasattr(value, n))
        elif name != "options":
            asked[name] = value
    return {n: v for n, v in asked.items() if not is_default(SPELLINGS.get(n, n), v)}


def _registry_problem(spec, strategy: str, keywords: dict, own: dict):
    """What is wrong with the strategy name, layout or keywords on this rank, or ``None``."""
    if spec is None:
        return ValueError, f"strategy must be one of {sorted(STRATEGIES)}, got {strategy!r}"
    refused = sorted(set(own) - set(spec.options))
    refused += sorted(n for n in _asked(keywords) if GROUPS[SPELLINGS.get(n, n)] != "every"
                      and SPELLINGS.get(n, n) not in spec.options)
    if refused:
        takers = [s.name for s in STRATEGIES.values()
                  if {SPELLINGS.get(n, n) for n in refused} <= set(s.options)]
        hint = f"; strategies that take {refused}: {takers}" if takers else ""
        return ValueError, (f"strategy {strategy!r} does not support {', '.join(n + '=' for n in refused)} "
                            f"(does not take option(s) {refused}); it takes {list(spec.options)}{hint}")
    layout = keywords.get("layout")
    if layout is not None and not isinstance(layout, str):
        if not spec.partitions:
            return ValueError, (f"strategy {strategy!r} takes layout names {list(spec.layouts)}, not a "
                                f"{type(layout).__name__}")
    elif layout is not None and layout not in spec.layouts:
        return ValueError, f"strategy {strategy!r} supports layout(s) {list(spec.layouts)}, got {layout!r}"
    return None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, strategy: str = "burst", **keywords):
    """Exact attention over sequence shards with the chosen ``strategy``.

    Takes exactly :func:`burstattn.burst_attn_func`'s keywords (``group``, ``causal``, ``softmax_scale``,
    ``layout``, ``window_size`` / ``window``, ``softcap``, ``alibi_slopes``, ``dropout_p``, ``deterministic``,
    ``return_lse``, ``options=BurstOptions(...)`` or its fields one by one), each where the strategy supports it
    (:data:`STRATEGIES`: ``strategy="burst"`` takes them all and runs the very path of ``burst_attn_func``), plus
    a strategy's own options (usp's ``ulysses_degree``, ...). Same conventions: ``q [B, n, Hq, D]``,
    ``k, v [B, n, Hkv, D]``, this rank's shard in ``layout`` exactly as :func:`burstattn.shard_sequence` gives it
    (one meaning for every strategy; ``None``: ``"zigzag"``, shard_sequence's default), output ``[B, n, Hq, D]``
    in q's dtype, differentiable (and ``lse [B, Hq, n]`` with ``return_lse=True``: burst and ring).

    Raises:
        ValueError: unknown strategy, a layout the strategy does not support, or a keyword it does not support
            given a value other than its default ("strategy 'tp' does not support window_size="; names what
            it takes), on every rank of the group. TypeError / ValueError as ``burst_attn_func`` for the keywords.
    """
    spec = STRATEGIES.get(strategy)
    own = {n: keywords.pop(n) for n in list(keywords) if n not in VOCABULARY}
    problem = _registry_problem(spec, strategy, keywords, own)
    if problem is None:
        try:
            kw = keywords_of(label(strategy), keywords, dict(spec.defaults))
        except (TypeError, ValueError) as e:
            problem = type(e), str(e).removeprefix(f"{label(strategy)}: ")
    if problem is not None:
        # raise on every rank: the ranks without this problem meet this check inside their
        # strategy (every strategy's first collective is the same input check)
        refuse(label(strategy), problem, keywords.get("group"))
    return MODULES[spec.name].run(q, k, v, kw, **own)


# imported with the package (not on first use) so that attention() is traceable by torch.compile
from . import allgather, burst, ring, rsa, tp, ulysses, usp  # noqa: E402

MODULES = MappingProxyType({m.__name__.rsplit(".", 1)[1]: m for m in (allgather, burst, ring, rsa, tp, ulysses, usp)})

__all__ = ["attention", "STRATEGIES", "StrategySpec"]

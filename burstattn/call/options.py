"""The rare keywords of :func:`burstattn.burst_attn_func` in one typed object, :class:`BurstOptions`.

``burst_attn_func`` keeps flash-attn's shape: ``q, k, v`` and its common keywords (``causal``,
``softmax_scale``, ``window_size``, ``softcap``, ``alibi_slopes``, ``dropout_p``, ``deterministic``) plus
the group and the layout; everything else is a field here. Every rare keyword is still accepted as a
keyword, as before (outside code passes them): :func:`burst_options` folds them into one object.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Optional

__all__ = ["BurstOptions", "burst_options", "mask_args", "RARE_KEYWORDS"]


@dataclass(frozen=True)
class BurstOptions:
    """The rare options of one attention call (see :func:`burstattn.burst_attn_func` for each meaning).

    Attributes:
        backend: local kernel (``"auto"``, ``"reference"``, ``"cpu_flash"``, ``"sdpa"``, ``"flash_attn"``).
        backward: ``"burst"`` (query ring), ``"kv"`` (K/V ring) or ``"auto"`` (fewer bytes).
        schedule: ``"ring"``, ``"distflash"`` or ``"double"`` (with ``topology``).
        topology: ``burstattn.two_level_groups(ranks_per_node)`` of schedule ``"double"``.
        kv_layout: the key/value sequence's own layout (``None``: ``layout``).
        cu_seqlens, cu_seqlens_q, cu_seqlens_k, max_seqlen, max_seqlen_q, max_seqlen_k: flash-attn's
            varlen documents (global positions).
        document_ids: packed documents as one id per global position.
        mask_mod: ``mask_mod(q_pos, k_pos) -> bool`` over global positions (runs eagerly).
        mask: a prebuilt :class:`burstattn.AttnMask` (caches its block summaries).
        sinks: ``[q_heads]`` attention-sink logits (differentiable).
        grad_partials: ``"auto"`` (default: ``"kernel"`` on CUDA, ``"float32"`` elsewhere), ``"float32"`` or
            ``"kernel"`` (see :func:`burstattn.kernels.policy.kernel_policy`).
        device_type: the device type the kernel policy is chosen for (``None``: the tensors' own; ``"cuda"``
            for a dry run's fake CPU tensors modelled on a GPU).
    """

    backend: str = "auto"
    backward: str = "auto"
    schedule: str = "ring"
    topology: Optional[Any] = None
    kv_layout: Optional[Any] = None
    cu_seqlens: Optional[Any] = None
    cu_seqlens_q: Optional[Any] = None
    cu_seqlens_k: Optional[Any] = None
    max_seqlen: Optional[int] = None
    max_seqlen_q: Optional[int] = None
    max_seqlen_k: Optional[int] = None
    document_ids: Optional[Any] = None
    mask_mod: Optional[Callable] = None
    mask: Optional[Any] = None
    sinks: Optional[Any] = None
    grad_partials: str = "auto"
    device_type: Optional[str] = None


RARE_KEYWORDS = tuple(f.name for f in fields(BurstOptions))
DEFAULTS = {f.name: f.default for f in fields(BurstOptions)}


def burst_options(fn: str, options: Optional[BurstOptions], rare: dict) -> dict:
    """Every rare option of the call by name: from ``options``, or from the rare keywords given one by one
    (``rare``; the rest default), not both. A plain mapping, so a compiled caller traces no object
    construction. Raises ``TypeError`` naming ``fn`` for an unknown keyword (listing the known ones) or an
    ``options`` that is not a :class:`BurstOptions`."""
    unknown = sorted(set(rare) - set(RARE_KEYWORDS))
    if unknown:
        raise TypeError(f"{fn}() got unexpected keyword argument(s) {unknown}; its rare keywords are the fields "
                        f"of burstattn.BurstOptions: {list(RARE_KEYWORDS)}")
    if options is None:
        return {name: rare.get(name, default) for name, default in DEFAULTS.items()}
    if not isinstance(options, BurstOptions):
        raise TypeError(f"{fn}: options must be a burstattn.BurstOptions, got {type(options).__name__}")
    if rare:
        raise TypeError(f"{fn}: give the rare keywords either in options=BurstOptions(...) or one by one, not "
                        f"both: got options and {sorted(rare)}")
    return {name: getattr(options, name) for name in RARE_KEYWORDS}


def mask_args(rare: dict, window) -> dict:
    """The keywords of :func:`burstattn.masks.setup.build_mask` from the rare options and the ``window``."""
    return dict(window=window, cu_seqlens=rare["cu_seqlens"], document_ids=rare["document_ids"],
                mask_mod=rare["mask_mod"], mask=rare["mask"], cu_seqlens_q=rare["cu_seqlens_q"],
                cu_seqlens_k=rare["cu_seqlens_k"], max_seqlen=rare["max_seqlen"], max_seqlen_q=rare["max_seqlen_q"],
                max_seqlen_k=rare["max_seqlen_k"])


def with_sinks(options: BurstOptions, sinks) -> BurstOptions:
    """``options`` with the module's own ``sinks`` (a parameter or buffer of :class:`burstattn.BurstAttention`)."""
    return options if sinks is None and options.sinks is None else replace(options, sinks=sinks)

"""The keywords of one attention call, written once: :class:`BurstOptions` (the rare ones, one typed object)
and :class:`Keywords` (all of them), dataclasses whose fields are the vocabulary of every front door.

``burst_attn_func`` keeps flash-attn's shape: ``q, k, v`` and its common keywords (``causal``,
``softmax_scale``, ``window_size``, ``softcap``, ``alibi_slopes``, ``dropout_p``, ``deterministic``,
``return_lse``) plus the group and the layout; everything else is a field of :class:`BurstOptions`, given as
``options=BurstOptions(...)`` or one by one as keywords (outside code passes them so).
:func:`keywords_of` folds whatever a front door was given into one :class:`Keywords`;
:func:`burstattn.call.prepare.prepare` builds the :class:`~burstattn.call.Call` from it, and
``attention(strategy=...)`` asks each field's ``metadata["group"]`` which strategies take it
(:data:`GROUPS`):

* ``"every"``: every strategy (``causal``, ``softmax_scale``, ``layout``, ``group``);
* ``"mask"``: the mask (the fields of :class:`~burstattn.masks.spec.MaskKeywords`);
* ``"schedule"``: how burst's ring runs (``backward``, ``schedule``, ``topology``);
* ``"model"``: what today's models add (cross-attention, score modifiers, sinks, flash-attn's flags, the
  kernel policy, the LSE);
* ``"kernel"``: the local kernel (``backend``: every strategy names it, some accept one value only).

Adding an option is a field here (its keyword, with its group), a field of ``Call`` of the same name, its
check (:mod:`burstattn.call.validate`) and its consumer: ``docs/architecture.md``, "What one option touches".
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Optional

from ..masks.spec import MASK_KEYWORDS, MaskKeywords

__all__ = ["BurstOptions", "Keywords", "keywords_of", "names_in", "is_default", "RARE_KEYWORDS", "KEYWORDS",
           "SPELLINGS", "given_keywords"]

EVERY, SCHEDULE, MODEL, KERNEL = ({"group": g} for g in ("every", "schedule", "model", "kernel"))


@dataclass(frozen=True, kw_only=True)
class BurstOptions(MaskKeywords):
    """The rare options of one attention call (the mask's fields are :class:`~burstattn.masks.spec.MaskKeywords`',
    inherited: ``window``, ``cu_seqlens``, ``cu_seqlens_q``, ``cu_seqlens_k``, ``max_seqlen``, ``max_seqlen_q``,
    ``max_seqlen_k``, ``document_ids``, ``mask_mod``, ``mask``).

    Attributes:
        kv_layout: the key/value sequence's own layout (``None``: ``layout``, applied to its own
            length).
        backend: local kernel: ``"auto"`` (the fastest that supports the call: softcap and ALiBi run
            on ``"reference"`` on CPU), ``"cpu_flash"``, ``"sdpa"`` (CUDA), ``"flash_attn"`` (CUDA,
            optional package; takes softcap), ``"reference"`` (plain PyTorch, every modifier).
        backward: ``"burst"`` (query ring), ``"kv"`` (K/V ring) or ``"auto"`` (fewer bytes).
        schedule: ``"ring"`` (default); ``"distflash"``: DistFlashAttn's load-balanced
            schedule for causal attention over the contiguous layout (idle early ranks compute
            blocks of the overloaded late ranks; K/V and queries go straight to the rank that
            needs them; needs ``causal=True``, ``layout="contiguous"``, ``backward="auto"`` and one
            sequence); ``"double"``: the two-level ring over ``topology`` (inner rings inside nodes,
            an outer ring across them; dense attention only).
        topology: ``burstattn.two_level_groups(ranks_per_node)`` (built once, on every rank) for
            ``schedule="double"``; refused with any other schedule.
        sinks: ``[q_heads]`` attention-sink logits (gpt-oss): each joins its head's softmax
            denominator once, at the final merge, with no value. Differentiable: each rank's
            ``sinks.grad`` is its own rows' share (sum it over the group, as for any replicated
            parameter; :func:`burstattn.hf.sync_gradients` does).
        grad_partials: ``"auto"`` (default): ``"kernel"`` on CUDA, ``"float32"`` elsewhere;
            ``"float32"``: every kernel's gradient partial of 16-bit inputs is float32 from the start
            (kernels run on float32 copies of one tile at a time), within flash-attn's accuracy rule;
            ``"kernel"``: one kernel call per block pair in the inputs' dtype, each partial rounded to 16
            bits before the float32 accumulation (flash-attn's own ring does the same). On CUDA a masked
            pair is one kernel call (docs/strategies.md, "What runs on a GPU").
        device_type: the device type the kernel policy is chosen for: ``None`` (the tensors' own) or
            ``"cuda"`` / ``"cpu"`` (a dry run models a GPU on fake CPU tensors).


    """

    backend: str = field(default="auto", metadata=KERNEL)
    backward: str = field(default="auto", metadata=SCHEDULE)
    schedule: str = field(default="ring", metadata=SCHEDULE)
    topology: Optional[Any] = field(default=None, metadata=SCHEDULE)
    kv_layout: Optional[Any] = field(default=None, metadata=MODEL)
    sinks: Optional[Any] = field(default=None, metadata=MODEL)
    grad_partials: str = field(default="auto", metadata=MODEL)
    device_type: Optional[str] = field(default=None, metadata=MODEL)


@dataclass(frozen=True, kw_only=True)
class Keywords(BurstOptions):
    """Every keyword of one attention call: flash-attn's common ones (below) and :class:`BurstOptions`' rare ones,
    as ``burst_attn_func``, ``BurstAttention`` and ``attention(strategy=...)`` take them (see
    :func:`burstattn.burst_attn_func` for each meaning). Built by :func:`keywords_of`, read by
    :func:`burstattn.call.prepare.prepare` and the strategies' ``run``.

    Attributes:
        causal, softmax_scale, layout, group: taken by every strategy.
        softcap, alibi_slopes, dropout_p, deterministic: flash-attn's score modifiers and flags.
        return_lse: also return the log-sum-exp ``[batch, q_heads, local_seq]`` (burst and ring).
    """

    causal: bool = field(default=False, metadata=EVERY)
    softmax_scale: Optional[float] = field(default=None, metadata=EVERY)
    layout: Any = field(default="zigzag", metadata=EVERY)
    group: Optional[Any] = field(default=None, metadata=EVERY)
    softcap: Optional[float] = field(default=None, metadata=MODEL)
    alibi_slopes: Optional[Any] = field(default=None, metadata=MODEL)
    dropout_p: float = field(default=0.0, metadata=MODEL)
    deterministic: bool = field(default=False, metadata=MODEL)
    return_lse: bool = field(default=False, metadata=MODEL)


def _group(f) -> str:
    return "mask" if f.name in MASK_KEYWORDS else f.metadata["group"]


KEYWORDS = tuple(f.name for f in fields(Keywords))
"""Every keyword's name (the fields of :class:`Keywords`)."""
RARE_KEYWORDS = tuple(f.name for f in fields(BurstOptions))
"""The fields of :class:`BurstOptions` (what ``options=`` holds)."""
GROUPS = {f.name: _group(f) for f in fields(Keywords)}
"""Each keyword's group (see the module docstring): which strategies take it."""
DEFAULTS = {f.name: f.default for f in fields(Keywords)}
SPELLINGS = {"window_size": "window"}
"""Other spellings of a keyword (flash-attn's ``window_size`` is burstattn's ``window``): give one of the two."""
OWN_KEYWORD = tuple(SPELLINGS.values())
"""Rare fields that are also keywords of their own beside ``options=`` (``window``, spelled ``window_size`` by
flash-attn): given both ways, the keyword fills the object's unset field."""
assert all(f.default is not MISSING for f in fields(Keywords))  # every keyword has a default


def names_in(*groups: str, keys: bool = True) -> tuple[str, ...]:
    """The keywords of ``groups`` (``keys=False``: without the keys' own documents, ``cu_seqlens_k`` and
    ``max_seqlen_k``, for strategies of one sequence)."""
    own = {f.name for f in fields(MaskKeywords) if f.metadata.get("keys")}
    return tuple(n for n in KEYWORDS if GROUPS[n] in groups and (keys or n not in own))


def is_default(name: str, value) -> bool:
    """Whether ``value`` is keyword ``name``'s default (a keyword at its default asks nothing of a strategy)."""
    default = DEFAULTS[name]
    return value is default or (type(value) is type(default) and value == default)


def keywords_of(fn: str, given: dict, defaults: Optional[dict] = None) -> Keywords:
    """One :class:`Keywords` of what a front door was given: keywords by name (``given``; any spelling of
    :data:`SPELLINGS`), the rare ones either in ``given["options"]`` (a :class:`BurstOptions`) or one by one,
    not both. ``defaults``: a strategy's own defaults for keywords given neither way.

    Raises:
        TypeError naming ``fn``: an unknown keyword (listing the known ones), ``options`` not a
            :class:`BurstOptions`, rare keywords given both ways.
        ValueError naming ``fn``: both spellings of one keyword (``window`` and ``window_size``).
    """
    given = dict(given)
    options = given.pop("options", None)
    for spelling, name in SPELLINGS.items():
        if given.get(spelling) is not None:
            if given.get(name) is not None:
                raise ValueError(f"{fn}: give {name} or {spelling} (flash-attn's spelling of the same value), not "
                                 f"both: got {name}={given[name]!r}, {spelling}={given[spelling]!r}")
            given[name] = given[spelling]
        given.pop(spelling, None)
    unknown = sorted(set(given) - set(KEYWORDS))
    if unknown:
        raise TypeError(f"{fn}() got unexpected keyword argument(s) {unknown}; its rare keywords are the fields "
                        f"of burstattn.BurstOptions: {list(RARE_KEYWORDS)}")
    given = {n: v for n, v in given.items() if not (n in OWN_KEYWORD and v is None)}  # an unset keyword of its own
    values = dict(defaults or {})
    if options is not None:
        if not isinstance(options, BurstOptions):
            raise TypeError(f"{fn}: options must be a burstattn.BurstOptions, got {type(options).__name__}")
        both = sorted(n for n in given if n in RARE_KEYWORDS and not (n in OWN_KEYWORD and getattr(options, n) is None))
        if both:
            raise TypeError(f"{fn}: give the rare keywords either in options=BurstOptions(...) or one by one, not "
                            f"both: got options and {both}")
        values.update((n, getattr(options, n)) for n in RARE_KEYWORDS if not is_default(n, getattr(options, n)))
    values.update(given)
    return Keywords(**values)


def given_keywords(frame: dict) -> dict:
    """The keywords a front door was called with, from its ``locals()`` taken first thing (its named keywords,
    and the rest in its ``**rare``), without ``q``, ``k``, ``v`` and ``self``: its signature is the one list."""
    given = {n: v for n, v in frame.items() if n not in ("q", "k", "v", "self", "rare", "__class__")}
    given.update(frame.get("rare", {}))
    return given

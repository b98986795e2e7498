"""Typed configuration shared by the public API, the autograd function and the engine, the op's
encoding of it (:class:`OpSpec`), and the one bounded memo of what calls build from it
(:class:`LruCache`: the data masks of the custom op, usp's sub-groups)."""
from __future__ import annotations

import ast
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:
    import torch

LAYOUTS = ("contiguous", "zigzag", "striped")
BACKENDS = ("auto", "reference", "cpu_flash", "sdpa", "flash_attn")
BACKWARDS = ("auto", "burst", "kv")
SCHEDULES = ("ring", "distflash", "double")
GRAD_PARTIALS = ("float32", "kernel")

Window = Optional[tuple[Optional[int], Optional[int]]]


def normalize_window(window, name: str = "window") -> Window:
    """The one window validator: ``window`` as ``(left, right)`` with ``None`` for an unbounded side,
    or ``None`` for no window at all.

    Accepts ``None``, or a pair of ints ``>= 0``, ``None`` or ``-1`` (flash-attn's ``window_size``
    convention: ``-1`` is an unbounded side, ``(-1, -1)`` no window). Query ``i`` then sees keys
    ``i - left <= j <= i + right``. Raises ``ValueError`` naming ``name`` and the bad entry.
    """
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(f"{name} must be a pair (left, right) of ints >= 0, None or -1 (unbounded), or None, "
                         f"got {window!r}")
    out = []
    for side, w in zip(("left", "right"), window):
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < -1):
            raise ValueError(f"{name} {side} must be an int >= 0, or None / -1 (unbounded), got {w!r}")
        out.append(None if w is None or w == -1 else int(w))
    return None if out == [None, None] else (out[0], out[1])


LOW_DTYPES = ("float32", "bfloat16", "float16")  # what models train and benchmarks run in, by name
DTYPE_NAMES = LOW_DTYPES + ("float64",)          # float64: the exact checks


def torch_dtype(name: str) -> "torch.dtype":
    """The torch dtype named ``name`` (one of :data:`DTYPE_NAMES`); ``ValueError`` otherwise."""
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {list(DTYPE_NAMES)}, got {name!r}")
    import torch

    return getattr(torch, name)


@dataclass(frozen=True)
class AttnConfig:
    """What one distributed attention call does (everything but the tensors and the group).

    Attributes:
        causal: query at global position i sees keys at global positions j <= i.
        softmax_scale: multiplier of q @ k^T; ``None`` means ``head_dim ** -0.5``.
        layout: how the global sequence is split over ranks: ``"contiguous"``,
            ``"zigzag"`` or ``"striped"`` (see :mod:`burstattn.layout`), or an explicit
            :class:`burstattn.partition.Partition` (e.g. from ``document_partition``).
        backend: local kernel name, resolved (never ``"auto"`` once inside the engine).
        backward: ``"burst"`` (query ring: Q, dO, lse, D travel, dQ partials follow),
            ``"kv"`` (RingAttention: K, V travel, dK/dV partials follow) or ``"auto"``.
        schedule: ``"ring"`` (neighbour ring, every layout), ``"distflash"`` (DistFlashAttn's
            load-balanced direct schedule: causal, contiguous layout only) or ``"double"`` (the
            two-level ring over ``topology``: nodes x ranks per node).
        kv_layout: how the key/value sequence is split (``None``: like the queries, ``layout``);
            with cross-attention the two sequences have their own lengths.
        softcap: Gemma 2 / Grok score capping ``softcap * tanh(s / softcap)`` of the scaled scores.
        alibi, sinks: whether ALiBi slopes / attention-sink logits come with the call.
        deterministic: flash-attn's flag (every path here is deterministic; see the API docs).
        grad_partials: ``"float32"`` (the default): every kernel's dQ/dK/dV partial is produced in
            float32 for 16-bit inputs (the kernel runs on float32 copies of one tile at a time), so
            nothing is rounded to 16 bits before the float32 accumulation; ``"kernel"``: the
            kernel's own output dtype (faster, up to one 16-bit rounding per partial).
    """

    causal: bool = False
    softmax_scale: Optional[float] = None
    layout: str = "zigzag"
    backend: str = "auto"
    backward: str = "auto"
    schedule: str = "ring"
    mask: Optional[object] = None  # a burstattn.AttnMask (None: no mask beyond ``causal``)
    topology: Optional[object] = None  # TwoLevelGroups of schedule="double"
    kv_layout: Optional[object] = None  # layout of the key/value sequence (None: ``layout``)
    softcap: Optional[float] = None  # scores -> softcap * tanh(scores / softcap) (None: off)
    alibi: bool = False  # the call has ALiBi slopes (the tensor travels beside the config)
    sinks: bool = False  # the call has attention-sink logits (the tensor travels beside the config)
    deterministic: bool = False
    grad_partials: str = "float32"  # "float32": kernel gradient partials in float32; "kernel": as returned
    grad: bool = False  # this rank will run the backward (checked across ranks: a rank without it hangs the others)

    @property
    def keys_layout(self):
        """The layout of the key/value sequence (``kv_layout``, else ``layout``)."""
        return self.layout if self.kv_layout is None else self.kv_layout

    @property
    def sparse(self) -> bool:
        """Whether the call's plan is a mask plan (:mod:`burstattn.masks.plan`: the sparse direct
        schedule that moves K/V only where some query sees them): it has a mask, or an explicit
        partition layout."""
        return self.mask is not None or not isinstance(self.layout, str) or not isinstance(self.keys_layout, str)

    def travelling(self, phase: str) -> str:
        """The side a ring moves in ``phase`` (the engine's name for the choice ``backward`` makes):
        ``"kv"`` in the forward and for ``backward="kv"``, else ``"q"`` (the query side:
        ``backward="burst"``; DistFlashAttn's direct steps, which move both, ignore it)."""
        return "kv" if phase == "forward" or self.backward == "kv" else "q"

    def mask_key(self, seq_len: Optional[int] = None) -> int:
        """31-bit checksum of the mask (its values, probed at ``seq_len``: see
        :meth:`burstattn.AttnMask.fingerprint`) and of an explicit partition (0: neither), for the
        cross-rank check."""
        parts = [self.mask.fingerprint(seq_len) if self.mask is not None else 0,
                 0 if isinstance(self.layout, str) else self.layout.fingerprint,
                 self.topology.ranks_per_node if self.topology is not None else 0,
                 0 if isinstance(self.keys_layout, str) else self.keys_layout.fingerprint]
        return (((parts[0] * 1_000_003 + parts[1]) * 1009 + parts[2]) * 1_000_033 + parts[3]) & 0x7FFFFFFF

    def scale_for(self, head_dim: int) -> float:
        """The softmax scale actually used for ``head_dim``."""
        return float(self.softmax_scale) if self.softmax_scale is not None else head_dim ** -0.5


@dataclass(frozen=True)
class OpSpec:
    """Everything of a call but tensors and the group, as op-argument-friendly values.

    Attributes:
        fn: the caller's name for error messages (``burst_attn_func``, ``attention(strategy='ring')``).
        causal, softmax_scale, backend, backward, schedule: as in :class:`~burstattn.config.AttnConfig`
            (backend and backward resolved).
        layout: a layout name, or ``"partition:NAME"`` (positions in the op's ``positions`` tensor).
        topology: ``[inner group name, outer group name, ranks_per_node, nodes]`` of schedule "double".
        window: ``[left, right]`` of a window mask (``None`` entries: unbounded); ``documents``: whether
            the op's ``bounds`` tensor holds document boundaries; ``block_size``: the mask's tile.
        kv_layout: the key sequence's layout (``None``: ``layout``; ``"partition:NAME"``: in
            ``kv_positions``); softcap, deterministic, grad_partials: as in ``AttnConfig``.
        strategy: the strategy that runs (``burstattn.strategies.op``'s ops); options: its own
            options as ``[name, value]`` pairs (usp's degrees and sub-group names), ``None``: none.
    """

    fn: str
    causal: bool
    softmax_scale: Optional[float]
    layout: str
    backend: str
    backward: str
    schedule: str
    topology: Optional[list] = None
    window: Optional[list] = None
    documents: bool = False
    block_size: int = 256
    kv_layout: Optional[str] = None
    softcap: Optional[float] = None
    deterministic: bool = False
    grad_partials: str = "float32"
    strategy: str = "burst"
    options: Optional[list] = None
    grad: bool = False

    def encode(self) -> str:
        """``key=value`` pairs joined by ``;`` (values as Python literals, lossless: see :func:`literal`).
        Plain string formatting, which the compiler folds to a constant (it cannot trace ``json``)."""
        return ";".join(f"{name}={literal(getattr(self, name))}" for name in FIELDS)

    @staticmethod
    def decode(text: str) -> "OpSpec":
        """The inverse of :meth:`encode`. Every forward and backward of the op decodes its spec, and a
        model's layers repeat one spec: parsed once (:data:`SPECS`; ~160 us a parse), the same frozen
        value after (its ``options`` are read, never changed)."""
        def parse() -> "OpSpec":
            pairs = (item.split("=", 1) for item in text.split(";"))
            return OpSpec(**{name: ast.literal_eval(value) for name, value in pairs})
        return SPECS.get(text, parse)


FIELDS = ("fn", "causal", "softmax_scale", "layout", "backend", "backward", "schedule", "topology", "window",
          "documents", "block_size", "kv_layout", "softcap", "deterministic", "grad_partials", "strategy", "options",
          "grad")
# characters a string literal of the spec may not hold raw: the field separator, the literal's own
# quote and escape, and what ends a line or a source text; each becomes its escape, so decoding gives
# the string back exactly
ESCAPES = (("\\", "\\\\"), ("'", "\\'"), (";", "\\x3b"), ("\n", "\\n"), ("\r", "\\r"),
           ("\x00", "\\x00"), ("\x0b", "\\x0b"), ("\x0c", "\\x0c"), ("\x1c", "\\x1c"), ("\x1d", "\\x1d"),
           ("\x1e", "\\x1e"), ("\x85", "\\x85"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029"))


def literal(x) -> str:
    """``x`` (None, bool, int, float, str, or a list of those) as a Python literal that holds no ``;``
    (the field separator) and that ``ast.literal_eval`` turns back into ``x`` exactly."""
    if isinstance(x, (list, tuple)):
        return "[" + ",".join(literal(e) for e in x) + "]"
    if isinstance(x, str):
        for raw, escaped in ESCAPES:
            x = x.replace(raw, escaped)
        return "'" + x + "'"
    return repr(x) if isinstance(x, float) else str(x)


class LruCache:
    """A bounded memo, least recently used entries evicted first: what a call builds from values that
    repeat from call to call (a mask's block summaries, a process group) is built once.

    ``entries``: the cached values by key (oldest first). Sharing one instance process-wide is safe as
    long as every value is a pure function of its key (or, for process groups, made by every rank in
    the same order, which the callers' cross-rank input check guarantees).
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.entries: OrderedDict = OrderedDict()

    def get(self, key, make: Callable[[], object], valid: Optional[Callable[[object], bool]] = None):
        """The value of ``key``: the cached one (unless ``valid(value)`` says it went stale), else
        ``make()``, cached."""
        hit = self.entries.get(key)
        if hit is not None and (valid is None or valid(hit)):
            self.entries.move_to_end(key)
            return hit
        value = make()
        self.entries[key] = value
        self.entries.move_to_end(key)
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)
        return value

    def clear(self) -> None:
        """Forget every entry (the values themselves live on where they are still referenced)."""
        self.entries.clear()


SPECS = LruCache(64)
"""The op specs decoded so far (:meth:`OpSpec.decode`): a pure function of the text."""


def host_side():
    """A context in which tensor code runs on real tensors even inside a ``FakeTensorMode`` (the dry
    run, :mod:`burstattn.train.dryrun`): for host-side bookkeeping that holds no device memory and is
    read on the host (a mesh's rank lists, the input check's signatures)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()

"""Typed configuration: the one :class:`Call` type of an attention call (read by the public API, the
strategies, the engine adapter and the checks), its generic text encoding for the custom op's constant
``spec`` (:func:`encode_spec` / :func:`decode_spec`), and the one bounded memo of what calls build from
it (:class:`LruCache`: the data masks of the custom op, usp's sub-groups)."""
from __future__ import annotations

import ast
from collections import OrderedDict
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:
    import torch

LAYOUTS = ("contiguous", "zigzag", "striped")
BACKENDS = ("auto", "reference", "cpu_flash", "sdpa", "flash_attn")
BACKWARDS = ("auto", "burst", "kv")
SCHEDULES = ("ring", "distflash", "double")
GRAD_PARTIALS = ("auto", "float32", "kernel")
DEVICE_TYPES = ("cpu", "cuda")  # what a step may be modelled on (Call.device_type)

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


RUNTIME = {"runtime": True}  # a field of the call that is not part of its spec (tensors, derived values)


@dataclass(frozen=True)
class Call:
    """One attention call, everything but q, k and v: built and checked once per call
    (:func:`burstattn.strategies.op.prepare`), read by every strategy, the engine adapter and the checks.

    Its fields are plain values (and a few typed values: a layout, a mask, a topology, the group), so it
    crosses the custom-op boundary generically (:func:`burstattn.boundary.op_arguments`): every field is
    written ``name=literal`` into the op's constant ``spec`` string; the typed values go through one
    codec per value type (a partition's positions and a mask's document bounds travel as tensors).
    Adding an option is adding a field here, its consumer and its check (``docs/architecture.md``).

    Attributes:
        strategy: the strategy that runs (``burstattn.strategies.NAME``: its ``check`` / ``forward`` / ...).
        fn: the caller's name in error messages (``burst_attn_func``, ``attention(strategy='ring')``).
        where: the process group, this rank and the world size (crosses the op by the group's name).
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
        mask: a :class:`burstattn.AttnMask` (``None``: no mask beyond ``causal``); the user's object
            (its block summaries are cached in it).
        topology: the :class:`~burstattn.groups.TwoLevelGroups` of schedule ``"double"``.
        kv_layout: how the key/value sequence is split (``None``: like the queries, ``layout``);
            with cross-attention the two sequences have their own lengths.
        softcap: Gemma 2 / Grok score capping ``softcap * tanh(s / softcap)`` of the scaled scores.
        deterministic: flash-attn's flag (every path here is deterministic; see the API docs).
        grad_partials: ``"auto"`` (the default): ``"kernel"`` on CUDA, ``"float32"`` elsewhere
            (:func:`burstattn.kernels.policy.kernel_policy`); ``"float32"``: every kernel's dQ/dK/dV partial
            is produced in float32 for 16-bit inputs (the kernel runs on float32 copies of one tile at a
            time), so nothing is rounded to 16 bits before the float32 accumulation; ``"kernel"``: the
            kernel's own output dtype (one kernel call per block pair; up to one 16-bit rounding per
            partial, accumulated in float32).
        device_type: the device type the kernel policy is chosen for: ``None`` (the tensors' own),
            ``"cuda"`` or ``"cpu"``; a dry run states ``"cuda"`` for its fake CPU tensors.
        grad: this rank will run the backward (checked across ranks: a rank without it hangs the others).
        options: the strategy's own options as sorted ``(name, value)`` pairs of ints and strings
            (usp's degrees or sub-group names).
        alibi: ALiBi slopes ``[Hq]`` / ``[B, Hq]`` (a tensor argument of the op of its own; not in the spec).
        sinks: attention-sink logits ``[Hq]`` (likewise; they get a gradient).
        plan: this rank's mask plan, derived by the strategy's check (not in the spec).
    """

    causal: bool = False
    softmax_scale: Optional[float] = None
    layout: object = field(default="zigzag", metadata={"codec": "layout"})  # a layout name or a Partition
    backend: str = "auto"
    backward: str = "auto"
    schedule: str = "ring"
    mask: Optional[object] = field(default=None, metadata={"codec": "mask"})
    topology: Optional[object] = field(default=None, metadata={"codec": "topology"})
    kv_layout: Optional[object] = field(default=None, metadata={"codec": "layout"})  # None: like ``layout``
    softcap: Optional[float] = None  # scores -> softcap * tanh(scores / softcap) (None: off)
    deterministic: bool = False
    grad_partials: str = "auto"  # "auto": "kernel" on CUDA, "float32" elsewhere (kernels.policy)
    device_type: Optional[str] = None  # the device the step is modelled on (None: the tensors')
    grad: bool = False
    strategy: str = "burst"
    fn: str = "burst_attn_func"
    where: object = field(default=None, metadata={"codec": "group"})  # a GroupContext (None: a world of one)
    options: tuple = ()
    alibi: Optional["torch.Tensor"] = field(default=None, metadata=RUNTIME)
    sinks: Optional["torch.Tensor"] = field(default=None, metadata=RUNTIME)
    plan: Optional[object] = field(default=None, metadata=RUNTIME)

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

    def option(self, name: str, default=None):
        """The strategy's own option ``name`` (``default`` when not given)."""
        return dict(self.options).get(name, default)

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


AttnConfig = Call
"""The former name of :class:`Call` (the config part of a call): the same type, kept for outside code."""

SPEC_FIELDS = tuple((f.name, f.metadata.get("codec")) for f in fields(Call) if not f.metadata.get("runtime"))
"""``(name, codec or None)`` of every field of :class:`Call` that its spec holds (all but the runtime
ones), in order: plain tuples, which the compiler iterates as constants."""


def encode_spec(values: dict) -> str:
    """``name=literal`` pairs of ``values`` (field name -> plain value: None, bool, int, float, str or
    nested lists / tuples of those) joined by ``;``, values as lossless Python literals (:func:`literal`).
    Plain string formatting, which the compiler folds to a constant (it cannot trace ``json``)."""
    return ";".join(f"{name}={literal(value)}" for name, value in values.items())


def decode_spec(text: str) -> dict:
    """The inverse of :func:`encode_spec` (lists come back as tuples). Every forward and backward of the op
    decodes its spec, and a model's layers repeat one spec: parsed once (:data:`SPECS`; ~160 us a parse),
    the same mapping after (read, never changed)."""
    def parse() -> dict:
        pairs = (item.split("=", 1) for item in text.split(";") if item)
        return MappingProxyType({name: _tupled(ast.literal_eval(value)) for name, value in pairs})
    return SPECS.get(text, parse)


def _tupled(x):
    return tuple(_tupled(e) for e in x) if isinstance(x, (list, tuple)) else x


# characters a string literal of the spec may not hold raw: the field separator, the literal's own
# quote and escape, and what ends a line or a source text; each becomes its escape, so decoding gives
# the string back exactly
ESCAPES = (("\\", "\\\\"), ("'", "\\'"), (";", "\\x3b"), ("\n", "\\n"), ("\r", "\\r"),
           ("\x00", "\\x00"), ("\x0b", "\\x0b"), ("\x0c", "\\x0c"), ("\x1c", "\\x1c"), ("\x1d", "\\x1d"),
           ("\x1e", "\\x1e"), ("\x85", "\\x85"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029"))


def literal(x) -> str:
    """``x`` (None, bool, int, float, str, or a list / tuple of those) as a Python literal that holds no
    ``;`` (the field separator) and that ``ast.literal_eval`` turns back into ``x`` exactly."""
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
"""The op specs decoded so far (:func:`decode_spec`): a pure function of the text."""


def host_side():
    """A context in which tensor code runs on real tensors even inside a ``FakeTensorMode`` (the dry
    run, :mod:`burstattn.train.dryrun`): for host-side bookkeeping that holds no device memory and is
    read on the host (a mesh's rank lists, the input check's signatures)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()

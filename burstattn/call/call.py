"""The one :class:`Call` type of an attention call: everything but q, k and v, built and checked once
(:func:`burstattn.call.prepare.prepare`), read by every strategy, the engine adapter and the checks,
carried across the custom op by :mod:`burstattn.call.boundary`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    import torch

RUNTIME = {"runtime": True}  # a field of the call that is not part of its spec (tensors, derived values)


@dataclass(frozen=True)
class Call:
    """One attention call, everything but q, k and v: built and checked once per call
    (:func:`burstattn.call.prepare.prepare`), read by every strategy, the engine adapter and the checks.

    Its fields are plain values (and a few typed values: a layout, a mask, a topology, the group), so it
    crosses the custom-op boundary generically (:func:`burstattn.call.boundary.op_arguments`): the op's constant
    ``spec`` string is the ``repr`` of the tuple of every spec field's value; the typed values go through one
    codec per value type (a partition's positions and a mask's document bounds travel as tensors). A field
    that a keyword of the same name fills (:class:`burstattn.call.options.Keywords`) is copied from it by
    :func:`~burstattn.call.prepare.prepare` (``metadata["keyword"]`` names another keyword; ``None``: built).
    Adding an option is its keyword, a field here, its check and its consumer (``docs/architecture.md``).

    Attributes:
        strategy: the strategy that runs (``burstattn.strategies.NAME``: its ``check`` / ``forward`` / ...).
        fn: the caller's name in error messages (``burst_attn_func``, ``attention(strategy='ring')``).
        where: the process group, this rank and the world size (crosses the op by the group's name).
        causal: query at global position i sees keys at global positions j <= i.
        softmax_scale: multiplier of q @ k^T; ``None`` means ``head_dim ** -0.5``.
        layout: how the global sequence is split over ranks: ``"contiguous"``,
            ``"zigzag"`` or ``"striped"`` (see :mod:`burstattn.layouts.named`), or an explicit
            :class:`burstattn.layouts.partition.Partition` (e.g. from ``document_partition``).
        backend: local kernel name, resolved (never ``"auto"`` once inside the engine).
        backward: ``"burst"`` (query ring: Q, dO, lse, D travel, dQ partials follow),
            ``"kv"`` (RingAttention: K, V travel, dK/dV partials follow) or ``"auto"``.
        schedule: ``"ring"`` (neighbour ring, every layout), ``"distflash"`` (DistFlashAttn's
            load-balanced direct schedule: causal, contiguous layout only) or ``"double"`` (the
            two-level ring over ``topology``: nodes x ranks per node).
        mask: a :class:`burstattn.AttnMask` (``None``: no mask beyond ``causal``); the user's object
            (its block summaries are cached in it).
        topology: the :class:`~burstattn.comm.groups.TwoLevelGroups` of schedule ``"double"``.
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
    mask: Optional[object] = field(default=None, metadata={"codec": "mask", "keyword": None})  # built by prepare
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
    alibi: Optional["torch.Tensor"] = field(default=None, metadata={**RUNTIME, "keyword": "alibi_slopes"})
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

    def scale_for(self, head_dim: int) -> float:
        """The softmax scale actually used for ``head_dim``."""
        return float(self.softmax_scale) if self.softmax_scale is not None else head_dim ** -0.5

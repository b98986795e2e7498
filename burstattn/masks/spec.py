"""Structured and sparse attention masks over *global* token positions.

A mask says which key positions each query position may see. :class:`AttnMask` combines (all
conditions must hold):

* ``window=(left, right)``: key j visible to query i iff ``i - left <= j <= i + right``
  (``None`` or ``-1`` on a side: unbounded, flash-attn's convention). With ``causal=True`` (an
  argument of the call, not of the mask) it is the usual causal sliding window ``(left, 0)``.
* packed documents, ``cu_seqlens`` (cumulative lengths ``[0, l0, l0+l1, ..., N]``, as
  flash-attn's varlen API takes them) or ``document_ids`` (one id per global position, each
  document one contiguous run): a token sees only tokens of its own document. With a key
  sequence of its own (cross-attention, a query block against a longer cache), ``cu_seqlens`` are
  the queries' documents and ``cu_seqlens_k`` the keys' (the same number of documents): query
  document d sees key document d.

Query and key sequences may differ in length (``Nq``, ``Nk``). Every position rule then works in
the keys' coordinates with flash-attn's bottom-right alignment: query i of document d stands at
``i + end_k(d) - end_q(d)`` (:meth:`AttnMask.aligned`; without documents ``i + Nk - Nq``), so the
last query of a document lines up with its last key. Equal lengths change nothing.
* ``mask_mod(q_pos, k_pos) -> bool``: any predicate over global positions (FlexAttention's
  convention, without batch and head): called with broadcastable LongTensors ``q_pos [R, 1]`` and
  ``k_pos [1, C]``, it must return a bool tensor broadcastable to ``[R, C]``.

Causal, window and documents make every query's visible keys one *interval* of global
positions, ``[lo(i), hi(i)]``; that is what lets the block summary (:mod:`.blocks`) classify
tiles in O(n) per tile row without evaluating a dense mask. ``mask_mod`` is evaluated only on
tiles the interval leaves non-empty, once per shape: the summaries are cached in the mask object
(keep one :class:`AttnMask` per model layer, or use :class:`burstattn.BurstAttention`, to reuse
them across calls).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Callable, Optional, Sequence, Union

import torch

from ..config import checksum, normalize_window

IntSeq = Union[Sequence[int], torch.Tensor]


def _as_long(x: IntSeq, name: str) -> torch.Tensor:
    if isinstance(x, torch.Tensor) and torch.compiler.is_compiling():
        # reading the boundaries' values is data-dependent: dynamo would stop with "Could not guard on
        # data-dependent expression" (under fullgraph=True) and name none of this
        raise ValueError(f"{name} inside torch.compile: the mask is built from the tensor's values, which a compiled "
                         f"graph cannot read; build it outside the compiled function, mask = burstattn.AttnMask("
                         f"{name}=...), and pass mask=mask")
    t = x if isinstance(x, torch.Tensor) else torch.as_tensor(list(x))
    if t.dim() != 1 or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"{name} must be a 1-D sequence of integers, got "
                         f"{'shape ' + str(tuple(t.shape)) if t.dim() != 1 else t.dtype}")
    return t.to(torch.int64).cpu()


def _cu(cu_seqlens, name: str) -> torch.Tensor:
    cu = _as_long(cu_seqlens, name)
    if cu.numel() < 2 or int(cu[0]) != 0:
        raise ValueError(f"{name} must start at 0 and hold at least one document, got {cu.tolist()[:8]}")
    if not bool((cu[1:] > cu[:-1]).all()):
        raise ValueError(f"{name} must be strictly increasing (no empty documents), got {cu.tolist()[:16]}")
    return cu


def _doc_bounds(cu_seqlens, document_ids) -> Optional[torch.Tensor]:
    """Document boundaries ``[0, ..., N]`` (LongTensor) from either description."""
    if cu_seqlens is not None and document_ids is not None:
        raise ValueError("pass cu_seqlens or document_ids, not both")
    if cu_seqlens is not None:
        return _cu(cu_seqlens, "cu_seqlens")
    if document_ids is not None:
        ids = _as_long(document_ids, "document_ids")
        if ids.numel() == 0:
            raise ValueError("document_ids must not be empty")
        change = torch.nonzero(ids[1:] != ids[:-1]).flatten() + 1
        starts = torch.cat([torch.zeros(1, dtype=torch.int64), change])
        run_ids = ids[starts]
        if torch.unique(run_ids).numel() != run_ids.numel():
            raise ValueError("document_ids: every document must be one contiguous run of positions "
                             "(an id appears in two separate runs); use mask_mod for other patterns")
        return torch.cat([starts, torch.tensor([ids.numel()])])
    return None


PROBE_ROWS = 64  # query rows on which fingerprint() evaluates a mask_mod (against every key)


@dataclass(frozen=True, eq=False)
class AttnMask:
    """A mask over global positions; see the module docstring. Build once, reuse: it caches its
    block summaries per (sequence length, world size, layout, rank pair, causal).

    Raises ``ValueError`` for a negative window, both ``cu_seqlens`` and ``document_ids``,
    boundaries that do not start at 0 or do not increase, ``mask_mod`` not callable, or
    ``block_size < 1``.
    """

    window: Optional[tuple[Optional[int], Optional[int]]] = None
    cu_seqlens: Optional[IntSeq] = None
    document_ids: Optional[IntSeq] = None
    mask_mod: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None
    block_size: int = 256
    cu_seqlens_k: Optional[IntSeq] = None
    cu_seqlens_q: Optional[IntSeq] = None
    """flash-attn's name for ``cu_seqlens`` (give one of the two), as ``burst_attn_func`` takes it."""
    bounds: Optional[torch.Tensor] = field(init=False, repr=False)
    kv_bounds: Optional[torch.Tensor] = field(init=False, repr=False)  # the keys' documents (None: bounds)
    cache: dict = field(init=False, repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "window", normalize_window(self.window))
        if self.cu_seqlens_q is not None:
            if self.cu_seqlens is not None:
                raise ValueError("pass cu_seqlens or cu_seqlens_q (the same thing), not both")
            object.__setattr__(self, "cu_seqlens", self.cu_seqlens_q)
        object.__setattr__(self, "bounds", _doc_bounds(self.cu_seqlens, self.document_ids))
        kv = None
        if self.cu_seqlens_k is not None:
            if self.bounds is None:
                raise ValueError("cu_seqlens_k needs the queries' documents too (cu_seqlens_q / cu_seqlens)")
            kv = _cu(self.cu_seqlens_k, "cu_seqlens_k")
            if kv.numel() != self.bounds.numel():
                raise ValueError(f"cu_seqlens_k must describe as many documents as the queries' cu_seqlens "
                                 f"({self.bounds.numel() - 1}), got {kv.numel() - 1}")
        object.__setattr__(self, "kv_bounds", kv)
        if self.mask_mod is not None and not callable(self.mask_mod):
            raise ValueError(f"mask_mod must be callable (q_pos, k_pos) -> bool tensor, got "
                             f"{type(self.mask_mod).__name__}")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {self.block_size!r}")

    @property
    def empty(self) -> bool:
        """Whether the mask restricts nothing (then the dense engine runs)."""
        return self.window is None and self.bounds is None and self.mask_mod is None

    @property
    def kind(self) -> str:
        """The mask's kind for the kernel policy (:data:`burstattn.kernels.policy.MASK_KINDS`): ``"none"``,
        ``"window"``, ``"documents"``, ``"documents+window"``, ``"mask_mod"`` or ``"mixed"`` (a ``mask_mod``
        with a window or documents)."""
        interval = [n for n, on in (("documents", self.bounds is not None), ("window", self.window is not None)) if on]
        if self.mask_mod is not None:
            return "mixed" if interval else "mask_mod"
        return "+".join(interval) if interval else "none"

    @property
    def keys_bounds(self) -> Optional[torch.Tensor]:
        """The key sequence's document boundaries (``cu_seqlens_k``, else the queries')."""
        return self.bounds if self.kv_bounds is None else self.kv_bounds

    def problem(self, seq_len: int, k_len: Optional[int] = None) -> Optional[str]:
        """Why this mask cannot apply to ``seq_len`` queries and ``k_len`` keys (default: as many),
        or ``None``."""
        k_len = seq_len if k_len is None else k_len
        if self.bounds is not None and int(self.bounds[-1]) != seq_len:
            what = "cu_seqlens must end at" if self.cu_seqlens is not None else "document_ids must have"
            return (f"{what} the global sequence length {seq_len} (local_seq x world_size), got "
                    f"{int(self.bounds[-1])}")
        if self.bounds is not None and self.kv_bounds is None and k_len != seq_len:
            return (f"the queries ({seq_len}) and keys ({k_len}) differ in length: give the keys' documents "
                    f"as cu_seqlens_k")
        if self.kv_bounds is not None and int(self.kv_bounds[-1]) != k_len:
            return (f"cu_seqlens_k must end at the global key length {k_len} (k.shape[1] x world_size), got "
                    f"{int(self.kv_bounds[-1])}")
        return None

    def longest(self, keys: bool = False) -> Optional[int]:
        """The longest query (``keys``: key) document, ``None`` without documents."""
        b = self.keys_bounds if keys else self.bounds
        return None if b is None else int((b[1:] - b[:-1]).max())

    def fingerprint(self, seq_len: Optional[int] = None) -> int:
        """A 31-bit checksum of what the mask is (equal on every rank that passes the same mask).

        A ``mask_mod`` is identified by its values, not its name: with ``seq_len`` given, it is
        evaluated on a probe of ``PROBE_ROWS`` evenly spaced query positions (first and last
        included) against every key position, so two predicates that differ anywhere on those rows
        (a prefix of 8 keys vs 40) give different checksums. A predicate that raises or returns a
        non-bool gives a checksum no other rank matches (the call's own check names the problem).
        """
        parts = [repr(self.window), str(self.block_size)]
        if self.bounds is not None:
            parts.append(self.bounds.numpy().tobytes().hex())
        if self.kv_bounds is not None:
            parts.append("k" + self.kv_bounds.numpy().tobytes().hex())
        if self.mask_mod is not None and seq_len:
            parts.append(self.probe(seq_len))
        elif self.mask_mod is not None:
            fn = self.mask_mod
            parts.append(f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__name__)}")
        return checksum("|".join(parts)) & 0x7FFFFFFF

    def probe(self, seq_len: int) -> str:
        """CRC-32 of ``mask_mod`` on the probe rows x every key (see :meth:`fingerprint`); cached."""
        key = ("probe", seq_len)
        if key not in self.cache:
            rows = torch.linspace(0, seq_len - 1, min(seq_len, PROBE_ROWS), dtype=torch.float64).round().long()
            keys, crc = torch.arange(seq_len), 0
            try:
                for chunk in rows.unique().split(8):  # 8 rows at a time: memory 8 x seq_len bools
                    crc = checksum(self.call_mod(chunk, keys), crc)
                self.cache[key] = f"{crc:08x}"
            except ValueError as e:  # no other rank can match this (the call's own check reports it)
                return f"raised {e} {id(self)}"
        return self.cache[key]

    def aligned(self, q_pos: torch.Tensor, seq_len: int, k_len: Optional[int] = None) -> torch.Tensor:
        """Query positions ``[R]`` in the keys' coordinates (bottom-right alignment, see the module
        docstring): ``q_pos + end_k(d) - end_q(d)`` for the query's document d (no documents:
        ``q_pos + k_len - seq_len``). The identity for equal sequences."""
        k_len = seq_len if k_len is None else k_len
        if self.bounds is None or self.kv_bounds is None:
            return q_pos + (k_len - seq_len) if k_len != seq_len else q_pos
        b, kb = self.bounds.to(q_pos.device), self.kv_bounds.to(q_pos.device)
        doc = torch.searchsorted(b, q_pos, right=True) - 1
        return q_pos + kb[doc + 1] - b[doc + 1]

    def intervals(self, q_pos: torch.Tensor, seq_len: int, causal: bool,
                  k_len: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Visible key interval ``[lo, hi]`` (inclusive, global key positions) of each query position.

        ``q_pos`` LongTensor ``[R]`` (global query positions, of ``seq_len`` queries against ``k_len``
        keys, default as many) -> ``lo, hi`` LongTensor ``[R]`` (``lo > hi``: sees nothing).
        ``mask_mod`` is not part of the interval (see :meth:`dense`).
        """
        k_len = seq_len if k_len is None else k_len
        at = self.aligned(q_pos, seq_len, k_len)
        lo = torch.zeros_like(q_pos)
        hi = torch.full_like(q_pos, k_len - 1)
        if causal:
            hi = torch.minimum(hi, at)
        if self.window is not None:
            left, right = self.window
            if left is not None:
                lo = torch.maximum(lo, at - left)
            if right is not None:
                hi = torch.minimum(hi, at + right)
        if self.bounds is not None:
            b, kb = self.bounds.to(q_pos.device), self.keys_bounds.to(q_pos.device)
            doc = torch.searchsorted(b, q_pos, right=True) - 1
            lo = torch.maximum(lo, kb[doc])
            hi = torch.minimum(hi, kb[doc + 1] - 1)
        return lo, hi

    def dense(self, q_pos: torch.Tensor, k_pos: torch.Tensor, seq_len: int, causal: bool,
              k_len: Optional[int] = None) -> torch.Tensor:
        """The mask as a bool tensor ``[R, C]`` for query positions ``[R]`` x key positions ``[C]``
        (True: visible). O(R*C): only for tiles and for the test oracle."""
        lo, hi = self.intervals(q_pos, seq_len, causal, k_len)
        vis = (k_pos[None, :] >= lo[:, None]) & (k_pos[None, :] <= hi[:, None])
        if self.mask_mod is not None:
            vis &= self.call_mod(q_pos, k_pos)
        return vis

    def call_mod(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """``mask_mod`` on ``q_pos [R] x k_pos [C]`` as a bool ``[R, C]``; raises ``ValueError``
        naming the problem when it raises or returns something else."""
        try:
            res = self.mask_mod(q_pos[:, None], k_pos[None, :])
        except Exception as e:  # a user predicate may raise anything: report it, on every rank
            raise ValueError(f"mask_mod raised {type(e).__name__}: {e}") from e
        if not isinstance(res, torch.Tensor) or res.dtype != torch.bool:
            raise ValueError(f"mask_mod must return a bool tensor, got "
                             f"{res.dtype if isinstance(res, torch.Tensor) else type(res).__name__}")
        try:
            return res.expand(q_pos.numel(), k_pos.numel())
        except RuntimeError as e:
            raise ValueError(f"mask_mod returned shape {tuple(res.shape)}, not broadcastable to "
                             f"[{q_pos.numel()}, {k_pos.numel()}] for q_pos [R, 1], k_pos [1, C]") from e


KEYS_OWN = {"keys": True}  # a keyword about the key sequence's own documents (cross-attention, unequal lengths)


@dataclass(frozen=True, kw_only=True)
class MaskKeywords:
    """The keywords of an attention call that describe its mask: the one place their names are written.
    :class:`burstattn.BurstOptions` (and so ``burst_attn_func``, ``BurstAttention`` and
    ``attention(strategy=...)``) inherits these fields; :meth:`build` turns them into one :class:`AttnMask`.

    Attributes:
        window: ``(left, right)`` sliding window: query i sees keys ``i - left <= j <= i + right``
            (``None`` or ``-1`` for an unbounded side, ``(-1, -1)``: no window, as flash-attn's
            ``window_size``); with ``causal=True`` right is cut at i. Aligned like ``causal``.
        cu_seqlens: packed documents as cumulative lengths (flash-attn varlen style, global
            positions, starting at 0 and ending at ``Nq``): a token sees its own document only.
            Excludes ``document_ids``.
        cu_seqlens_q: flash-attn's name for ``cu_seqlens`` (give one of the two).
        cu_seqlens_k: the keys' documents when the key sequence differs (ending at ``Nk``, as many
            documents): query document d sees key document d, aligned bottom-right per document.
        max_seqlen: accepted for flash-attn compatibility (nothing is sized by it): ``None`` or an
            int; one shorter than the longest document raises ``ValueError``.
        max_seqlen_q: the same for the query documents.
        max_seqlen_k: the same for the key documents.
        document_ids: packed documents as one id per global position (``[seq]``, non-decreasing).
        mask_mod: ``mask_mod(q_pos, k_pos) -> bool tensor`` over global positions (broadcast
            ``[R, 1] x [1, C]``, True = visible; each in its own sequence's positions), combined with
            the above; the ranks must pass the same predicate (checked by its values). Runs eagerly
            (not as the custom op).
        mask: a prebuilt :class:`burstattn.AttnMask` (caches its block summaries: build it once and
            reuse it); excludes window, cu_seqlens (_q, _k), document_ids and mask_mod.
    """

    window: Optional[tuple] = None
    cu_seqlens: Optional[IntSeq] = None
    cu_seqlens_q: Optional[IntSeq] = None
    cu_seqlens_k: Optional[IntSeq] = field(default=None, metadata=KEYS_OWN)
    max_seqlen: Optional[int] = None
    max_seqlen_q: Optional[int] = None
    max_seqlen_k: Optional[int] = field(default=None, metadata=KEYS_OWN)
    document_ids: Optional[IntSeq] = None
    mask_mod: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None
    mask: Optional[AttnMask] = None

    def build(self) -> Optional[AttnMask]:
        """The call's mask (``None``: no mask). ``mask`` (a prebuilt, caching :class:`AttnMask`) excludes the
        others; ``cu_seqlens_q`` is ``cu_seqlens`` under flash-attn's varlen name (give one of them),
        ``cu_seqlens_k`` the keys' documents. Raises ``ValueError`` naming the problem."""
        cu_seqlens = self.cu_seqlens
        if self.cu_seqlens_q is not None:
            if cu_seqlens is not None:
                raise ValueError("pass cu_seqlens or cu_seqlens_q (the same thing), not both")
            cu_seqlens = self.cu_seqlens_q
        given = [n for n, v in (("window", self.window), ("cu_seqlens", cu_seqlens), ("document_ids", self.document_ids),
                                ("mask_mod", self.mask_mod), ("cu_seqlens_k", self.cu_seqlens_k)) if v is not None]
        if self.mask is not None:
            if not isinstance(self.mask, AttnMask):
                raise ValueError(f"mask must be a burstattn.AttnMask, got {type(self.mask).__name__}")
            if given:
                raise ValueError(f"pass either mask=AttnMask(...) or {given}, not both")
            return None if self.mask.empty else self.mask
        if not given:
            return None
        built = AttnMask(window=self.window, cu_seqlens=cu_seqlens, document_ids=self.document_ids,
                         mask_mod=self.mask_mod, cu_seqlens_k=self.cu_seqlens_k)
        return None if built.empty else built

    def seqlen_problem(self, built: Optional[AttnMask]) -> Optional[tuple[type, str]]:
        """Why ``max_seqlen`` / ``max_seqlen_q`` / ``max_seqlen_k`` do not fit the documents of ``built``
        (flash-attn would silently compute a wrong result with one too short), or ``None``."""
        if self.max_seqlen is not None and (self.max_seqlen_q is not None or self.max_seqlen_k is not None):
            return ValueError, "pass max_seqlen or max_seqlen_q / max_seqlen_k, not both"
        for name, value, keys in (("max_seqlen", self.max_seqlen, None), ("max_seqlen_q", self.max_seqlen_q, False),
                                  ("max_seqlen_k", self.max_seqlen_k, True)):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                return TypeError, f"{name} must be None or a positive int, got {value!r}"
            longest = [built.longest(k) for k in ((False, True) if keys is None else (keys,))] if built else []
            longest = max((x for x in longest if x is not None), default=None)
            if longest is not None and value < longest:
                return ValueError, f"{name}={value} is shorter than the longest document ({longest} tokens)"
        return None


MASK_KEYWORDS = tuple(f.name for f in fields(MaskKeywords))
"""The mask keywords' names, from :class:`MaskKeywords` (in field order)."""
ONE_SEQUENCE_MASK_KEYWORDS = tuple(f.name for f in fields(MaskKeywords) if not f.metadata.get("keys"))
"""The mask keywords of one sequence (all but the keys' own documents): what strategies that gather one
sequence (ulysses, allgather) take."""


def make_mask(**keywords) -> Optional[AttnMask]:
    """The call's mask from the mask keywords (:class:`MaskKeywords`' fields; ``None``: no mask): see
    :meth:`MaskKeywords.build`. Raises ``TypeError`` for another keyword, ``ValueError`` for a bad mask."""
    return MaskKeywords(**keywords).build()

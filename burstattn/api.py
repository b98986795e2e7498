"""Public entry points: :func:`burst_attn_func` and the :class:`BurstAttention` module."""
from __future__ import annotations

import inspect
from dataclasses import replace
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from .call.options import KEYWORDS, BurstOptions, given_keywords, keywords_of
from .masks.setup import build_mask
from .masks.spec import MASK_KEYWORDS
from .strategies import burst


def burst_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, dropout_p: float = 0.0,
                    softmax_scale: Optional[float] = None, causal: bool = False, window_size=None,
                    softcap: Optional[float] = None, alibi_slopes: Optional[torch.Tensor] = None,
                    deterministic: bool = False, return_lse: bool = False,
                    group: Optional[dist.ProcessGroup] = None, layout: str = "zigzag", window=None,
                    options: Optional[BurstOptions] = None, **rare):
    """Exact softmax attention over a sequence sharded across the ranks of ``group``.

    flash-attn's ``flash_attn_func`` shape: ``q, k, v`` and its keywords (``dropout_p``, ``softmax_scale``,
    ``causal``, ``window_size``, ``softcap``, ``alibi_slopes``, ``deterministic``; ``return_lse`` for its
    ``return_attn_probs``), plus the ``group`` and the ``layout`` of the shards. The rare options are one
    typed object, ``options=burstattn.BurstOptions(...)``; each is also accepted as a keyword of its own,
    as before (see ``options`` below); not both ways at once.

    Every rank passes its own shard (see :func:`burstattn.shard_sequence`); K/V circulate
    around the ring and partial results merge by log-sum-exp, so no rank ever holds a
    ``local_seq x seq`` score matrix. Runs as the custom op ``torch.ops.burstattn.attention_fwd``
    (:mod:`burstattn.ops`): ``torch.compile(..., fullgraph=True)`` and selective checkpointing
    see it (calls with ``mask_mod`` run eagerly).

    Args:
        q: ``[batch, local_seq, q_heads, head_dim]``: this rank's shard of ``Nq = local_seq * P`` queries.
        k: ``[batch, kv_local_seq, kv_heads, head_dim]``, v: ``[batch, kv_local_seq, kv_heads, v_head_dim]``:
            this rank's shard of ``Nk = kv_local_seq * P`` keys; ``q_heads % kv_heads == 0`` (GQA/MQA:
            K/V travel at kv_heads size). ``kv_local_seq`` may differ from ``local_seq`` (cross-attention,
            a query block against a longer cache) and ``v_head_dim`` from ``head_dim`` (MLA): K and V
            travel at their own sizes and ``out`` has V's head size.
        group: process group (default: the world; a world of one if torch.distributed is
            not initialised).
        causal: ``True`` or ``False`` (a bool, nothing else): global query i attends to keys
            ``j <= i + Nk - Nq`` (positions per ``layout``; flash-attn's bottom-right alignment, i.e.
            ``j <= i`` for one sequence). Queries aligned before the first key see nothing.
        softmax_scale: scale of ``q @ k^T`` (a positive real: float, int, NumPy float or 0-d
            tensor; not a bool); default ``head_dim ** -0.5``.
        layout: ``"zigzag"`` (default, balanced causal), ``"striped"`` or ``"contiguous"``:
            how the global sequence was split; must match how the inputs were sharded. Or an
            explicit :class:`burstattn.Partition` (e.g. :func:`burstattn.document_partition`);
            ``None`` means ``"zigzag"`` (as everywhere).
        return_lse: also return the log-sum-exp ``[batch, q_heads, local_seq]``, float32
            (float64 for float64 inputs, which are accumulated in float64 throughout)
            (not differentiable). A row that sees no key has output 0 and LSE ``-inf`` (with
            ``sinks``: the sink's logit), never NaN.
        window: ``(left, right)`` sliding window: query i sees keys ``i - left <= j <= i + right``
            (``None`` or ``-1`` for an unbounded side, ``(-1, -1)``: no window, as flash-attn's
            ``window_size``); with ``causal=True`` right is cut at i. Aligned like ``causal``.
        window_size: flash-attn's spelling of ``window`` (``(left, right)``, ``-1`` unbounded); give
            one of the two.
        softcap: Gemma 2 / Grok logit capping ``softcap * tanh(s / softcap)`` of the scaled scores
            (``None`` or ``0.0``: off). Applied inside every block: empty blocks stay skipped.
        alibi_slopes: ``[q_heads]`` or ``[batch, q_heads]`` floats (used in float32): the score of
            query i and key j gets ``-slope * |i + Nk - Nq - j|`` from GLOBAL positions (flash-attn's
            bias; per document with ``cu_seqlens_k``).
        dropout_p: must be 0 (accepted for flash-attn compatibility; attention dropout is refused).
        deterministic: accepted for flash-attn compatibility: results are always bitwise
            repeatable for the same inputs and world size (fixed merge and accumulation order; on
            CUDA it also selects a deterministic kernel: flash-attn's deterministic backward or the
            plain one, never SDPA's atomics).
        options: a :class:`burstattn.BurstOptions` holding the rare options, or its fields given as keywords
            one by one (not both): ``backend``, ``backward``, ``schedule``, ``topology``, ``kv_layout``,
            ``sinks``, ``grad_partials``, ``device_type`` (documented on :class:`burstattn.BurstOptions`) and
            the mask's ``cu_seqlens`` (``_q``, ``_k``), ``max_seqlen`` (``_q``, ``_k``), ``document_ids``,
            ``mask_mod``, ``mask`` (documented on :class:`burstattn.masks.spec.MaskKeywords`, which also holds
            ``window``). Their one definition is :class:`burstattn.call.options.Keywords`: ``attention(strategy=
            "burst")`` and :class:`BurstAttention` take the same keywords and run the same path.

    Returns:
        ``out [batch, local_seq, q_heads, v_head_dim]`` in q's dtype (and ``lse``). Under
        ``torch.autocast`` the inputs are used in their own dtype (attention is not an autocast
        op here; cast q, k, v yourself), and ``out`` has q's dtype: every strategy does the same.

    Raises:
        TypeError / ValueError on every rank of the group if any rank's arguments are
        invalid or the ranks disagree on shapes or options (or on the mask).
        RuntimeError: a second-order gradient (double backward) is asked for.
    """
    keywords = keywords_of("burst_attn_func", given_keywords(locals()))  # first: locals() are the keywords
    return burst.run(q, k, v, keywords, fn="burst_attn_func")


def signature_of(fn, skip: tuple, first: str) -> inspect.Signature:
    """``fn``'s signature without the parameters ``skip``, starting with ``first`` (a method's ``self``)."""
    sig = inspect.signature(fn)
    params = [p for p in sig.parameters.values() if p.name not in skip]
    return sig.replace(parameters=[inspect.Parameter(first, inspect.Parameter.POSITIONAL_OR_KEYWORD), *params])


class BurstAttention(nn.Module):
    """:func:`burst_attn_func` as a module: ``forward(q, k, v) -> out`` (or ``(out, lse)`` with
    ``return_lse=True``). Takes every keyword of :func:`burst_attn_func` (its signature; the rare ones in
    ``options`` or one by one), read into one :class:`~burstattn.call.options.Keywords`, ``self.options``
    (``module.causal``, ``module.backend``, ... read it); the mask keywords are built into one
    :class:`~burstattn.AttnMask` for the module's lifetime (the op finds that object again, so a mask's block
    summary is built once per shape, and held in it). ``sinks`` given as an ``nn.Parameter`` becomes the
    module's parameter (learned sinks); ``alibi_slopes`` is kept as a buffer. ``forward`` runs the very path
    of :func:`burst_attn_func` (:func:`burstattn.strategies.burst.run`)."""

    def __init__(self, **keywords) -> None:
        super().__init__()
        kw = keywords_of("BurstAttention", keywords)
        amask, problem = build_mask(kw)  # one AttnMask for the module's lifetime: summaries built once per shape
        if problem:
            raise problem[0](f"BurstAttention: {problem[1]}")
        self.mask = amask
        if isinstance(kw.sinks, nn.Parameter):
            self.sinks = kw.sinks
        else:
            self.register_buffer("sinks", kw.sinks, persistent=False)
        self.register_buffer("alibi_slopes", kw.alibi_slopes, persistent=False)
        # the keywords with the mask built (its own keywords cleared), the module's tensors held apart
        self.options = replace(kw, **{**dict.fromkeys(MASK_KEYWORDS), "mask": amask}, sinks=None, alibi_slopes=None)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """``q [B, n, Hq, D]``, ``k [B, n_k, Hkv, D]``, ``v [B, n_k, Hkv, Dv]`` -> ``[B, n, Hq, Dv]`` (and
        ``lse [B, Hq, n]``)."""
        keywords = self.options
        if self.sinks is not None or self.alibi_slopes is not None:
            keywords = replace(keywords, sinks=self.sinks, alibi_slopes=self.alibi_slopes)
        return burst.run(q, k, v, keywords, fn="burst_attn_func")

    def __getattr__(self, name: str):
        # a keyword by name (module.causal, module.backend, ...): the module's options
        options = self.__dict__.get("options")
        if options is not None and name in KEYWORDS and name not in ("sinks", "alibi_slopes"):
            return getattr(options, name)
        return super().__getattr__(name)

    def extra_repr(self) -> str:
        o = self.options
        return (f"causal={o.causal}, layout={o.layout!r}, backend={o.backend!r}, "
                f"backward={o.backward!r}, schedule={o.schedule!r}")


BurstAttention.__init__.__signature__ = signature_of(burst_attn_func, skip=("q", "k", "v"), first="self")

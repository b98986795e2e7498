"""Public entry points: :func:`burst_attn_func` and the :class:`BurstAttention` module."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from .call.options import BurstOptions, burst_options, mask_args, with_sinks
from .call.prepare import prepare
from .masks.setup import build_mask
from .ops import run_call


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
    as before (``backend=``, ``backward=``, ``schedule=``, ``topology=``, ``kv_layout=``, ``cu_seqlens=``
    (``_q``, ``_k``), ``max_seqlen`` (``_q``, ``_k``), ``document_ids=``, ``mask_mod=``, ``mask=``, ``sinks=``,
    ``grad_partials=``); not both ways at once.

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
        kv_layout: the key/value sequence's own layout (``None``: ``layout``, applied to its own
            length).
        return_lse: also return the log-sum-exp ``[batch, q_heads, local_seq]``, float32
            (float64 for float64 inputs, which are accumulated in float64 throughout)
            (not differentiable). A row that sees no key has output 0 and LSE ``-inf`` (with
            ``sinks``: the sink's logit), never NaN.
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
        window: ``(left, right)`` sliding window: query i sees keys ``i - left <= j <= i + right``
            (``None`` or ``-1`` for an unbounded side, ``(-1, -1)``: no window, as flash-attn's
            ``window_size``); with ``causal=True`` right is cut at i. Aligned like ``causal``.
        window_size: flash-attn's spelling of ``window`` (``(left, right)``, ``-1`` unbounded); give
            one of the two.
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
        topology: ``burstattn.two_level_groups(ranks_per_node)`` (built once, on every rank) for
            ``schedule="double"``; refused with any other schedule.
        softcap: Gemma 2 / Grok logit capping ``softcap * tanh(s / softcap)`` of the scaled scores
            (``None`` or ``0.0``: off). Applied inside every block: empty blocks stay skipped.
        alibi_slopes: ``[q_heads]`` or ``[batch, q_heads]`` floats (used in float32): the score of
            query i and key j gets ``-slope * |i + Nk - Nq - j|`` from GLOBAL positions (flash-attn's
            bias; per document with ``cu_seqlens_k``).
        sinks: ``[q_heads]`` attention-sink logits (gpt-oss): each joins its head's softmax
            denominator once, at the final merge, with no value. Differentiable: each rank's
            ``sinks.grad`` is its own rows' share (sum it over the group, as for any replicated
            parameter; :func:`burstattn.hf.sync_gradients` does).
        dropout_p: must be 0 (accepted for flash-attn compatibility; attention dropout is refused).
        deterministic: accepted for flash-attn compatibility: results are always bitwise
            repeatable for the same inputs and world size (fixed merge and accumulation order; on
            CUDA it also selects a deterministic kernel: flash-attn's deterministic backward or the
            plain one, never SDPA's atomics).
        options: a :class:`burstattn.BurstOptions` holding the rare options below (backend, backward,
            schedule, topology, kv_layout, cu_seqlens (_q, _k), max_seqlen (_q, _k), document_ids, mask_mod,
            mask, sinks, grad_partials, device_type); or give them as keywords one by one (not both).
        grad_partials: ``"auto"`` (default): ``"kernel"`` on CUDA, ``"float32"`` elsewhere;
            ``"float32"``: every kernel's gradient partial of 16-bit inputs is float32 from the start
            (kernels run on float32 copies of one tile at a time), within flash-attn's accuracy rule;
            ``"kernel"``: one kernel call per block pair in the inputs' dtype, each partial rounded to 16
            bits before the float32 accumulation (flash-attn's own ring does the same). On CUDA a masked
            pair is one kernel call (docs/strategies.md, "What runs on a GPU").
        device_type: the device type the kernel policy is chosen for: ``None`` (the tensors' own) or
            ``"cuda"`` / ``"cpu"`` (a dry run models a GPU on fake CPU tensors).

    Returns:
        ``out [batch, local_seq, q_heads, v_head_dim]`` in q's dtype (and ``lse``). Under
        ``torch.autocast`` the inputs are used in their own dtype (attention is not an autocast
        op here; cast q, k, v yourself), and ``out`` has q's dtype: every strategy does the same.

    Raises:
        TypeError / ValueError on every rank of the group if any rank's arguments are
        invalid or the ranks disagree on shapes or options (or on the mask).
        RuntimeError: a second-order gradient (double backward) is asked for.
    """
    window = window_spelling("burst_attn_func", window, window_size)
    o = burst_options("burst_attn_func", options, rare)
    call = prepare("burst", q, k, v, fn="burst_attn_func", group=group, causal=causal, softmax_scale=softmax_scale,
                   layout=layout, backend=o["backend"], backward=o["backward"], schedule=o["schedule"],
                   topology=o["topology"], mask_args=mask_args(o, window), kv_layout=o["kv_layout"], softcap=softcap,
                   alibi_slopes=alibi_slopes, sinks=o["sinks"], dropout_p=dropout_p, deterministic=deterministic,
                   grad_partials=o["grad_partials"], device_type=o["device_type"])
    out, lse = run_call(call, q, k, v)
    return (out, lse) if return_lse else out


def window_spelling(fn: str, window, window_size):
    """``window`` from either spelling: burstattn's ``window`` or flash-attn's ``window_size`` (the same
    ``(left, right)`` convention); both at once is refused."""
    if window_size is None:
        return window
    if window is not None:
        raise ValueError(f"{fn}: give window or window_size (flash-attn's spelling of the same "
                         f"(left, right)), not both: got window={window!r}, window_size={window_size!r}")
    return window_size


class BurstAttention(nn.Module):
    """:func:`burst_attn_func` as a module: ``forward(q, k, v) -> out`` (or ``(out, lse)`` with
    ``return_lse=True``). Takes every keyword of :func:`burst_attn_func` (the rare ones in ``options`` or one
    by one); the mask keywords are built into one :class:`~burstattn.AttnMask` for the module's lifetime
    (the op finds that object again, so a mask's block summary is built once per shape, and held in it).
    ``sinks`` given as an ``nn.Parameter`` becomes the module's parameter (learned sinks);
    ``alibi_slopes`` is kept as a buffer."""

    def __init__(self, *, dropout_p: float = 0.0, softmax_scale: Optional[float] = None, causal: bool = False,
                 window_size=None, softcap: Optional[float] = None, alibi_slopes: Optional[torch.Tensor] = None,
                 deterministic: bool = False, return_lse: bool = False, group: Optional[dist.ProcessGroup] = None,
                 layout: str = "zigzag", window=None, options: Optional[BurstOptions] = None, **rare) -> None:
        super().__init__()
        window = window_spelling("BurstAttention", window, window_size)
        o = burst_options("BurstAttention", options, rare)
        self.group, self.causal, self.softmax_scale, self.layout = group, causal, softmax_scale, layout
        self.return_lse, self.dropout_p, self.deterministic, self.softcap = return_lse, dropout_p, deterministic, softcap
        self.backend, self.backward, self.schedule = o["backend"], o["backward"], o["schedule"]
        sinks = o["sinks"]
        if isinstance(sinks, nn.Parameter):
            self.sinks = sinks
        else:
            self.register_buffer("sinks", sinks, persistent=False)
        self.register_buffer("alibi_slopes", alibi_slopes, persistent=False)
        # one AttnMask for the module's lifetime: its block summaries are built once per shape
        amask, problem = build_mask(**mask_args(o, window))
        if problem:
            raise problem[0](f"BurstAttention: {problem[1]}")
        self.mask = amask
        self.options = BurstOptions(backend=o["backend"], backward=o["backward"], schedule=o["schedule"],
                                    topology=o["topology"], kv_layout=o["kv_layout"], mask=amask,
                                    grad_partials=o["grad_partials"], device_type=o["device_type"])

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """``q [B, n, Hq, D]``, ``k [B, n_k, Hkv, D]``, ``v [B, n_k, Hkv, Dv]`` -> ``[B, n, Hq, Dv]`` (and
        ``lse [B, Hq, n]``)."""
        return burst_attn_func(q, k, v, dropout_p=self.dropout_p, softmax_scale=self.softmax_scale, causal=self.causal,
                               softcap=self.softcap, alibi_slopes=self.alibi_slopes, deterministic=self.deterministic,
                               return_lse=self.return_lse, group=self.group, layout=self.layout,
                               options=with_sinks(self.options, self.sinks))

    def extra_repr(self) -> str:
        return (f"causal={self.causal}, layout={self.layout!r}, backend={self.backend!r}, "
                f"backward={self.backward!r}, schedule={self.schedule!r}")

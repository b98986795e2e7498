"""Exact state passing across ranks for the linear recurrences (LASP-2 style, in chunked form).

Every rank, for each of its segments (:mod:`.segments`: one under ``contiguous``, two under
``zigzag``, more under partitions and packed documents), runs the chunked recurrence from a zero
state and obtains:

* ``o0``: the segment's outputs from a zero initial state;
* ``corr [L, dk]``: per token, the read-out of the initial state (``q_t @ M_{<=t}``, ``M`` the
  transition so far), so that the true output is ``o0 + corr @ S_in``;
* the summary ``(A, B)``: the segment's end state is ``A @ S_in + B``.

For the gated delta rule ``A`` is a ``dk x dk`` matrix per head; every state column evolves
alone, so running ``dk`` identity columns next to ``v`` (values ``[v | 0]``, initial state
``[0 | I]``) yields ``[o0 | corr]`` and ``[B | A]`` in one pass. For a scalar decay ``A`` is the
chunk's total decay and ``corr = q_t * exp(G_t)``.

Only the summaries another rank reads travel (the segments whose document continues on another
rank: at most two per rank under ``zigzag``, whatever the number of packed documents), by one of two
schemes (:mod:`.schemes`): all-gathered and folded by every rank in position order (from zero at
every document start), or a log-depth prefix scan over point-to-point rounds whose memory does not
grow with the ranks (:mod:`.scan`). Each rank then corrects its outputs. Autograd does the backward
through the collectives' adjoints (the state gradient from later segments reaches each summary's owner).

The final state (after position ``N - 1``) is returned on every rank; only the copy of the rank
that holds position ``N - 1`` carries a gradient (it owns it, as it owns that token's output).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ..comm.agree import agree, entries
from ..comm.groups import group_context
from ..comm.host import host_side
from ..comm.stats import active_stats
from ..config import accum_dtype, checksum
from ..layouts.named import check_layout, layout_or_default
from ..layouts.partition import _check_cu_seqlens
from .checks import dim, tensors_problem
from .chunk_scan import BLOCK_CHUNKS, block_scan
from .chunked import chunk_delta_rule, chunk_linear_attention
from .comm import sum_grad
from .kernels import fla_delta_local, fla_linear_local, is_fake, kernel_problem, resolve_kernel
from .schemes import SCHEMES, Packer, fold_allgather, fold_scan, resolve_scheme, route
from .segments import segment_plan


def _layout_key(layout) -> str:
    return layout if isinstance(layout, str) else f"partition {layout.fingerprint:08x}"


def _cu_key(cu_seqlens) -> str:
    return "None" if cu_seqlens is None else f"crc32 {checksum(_check_cu_seqlens(cu_seqlens)):08x}"


def check_every_rank(fn: str, fields: dict, problem: Optional[str], group) -> None:
    """Raise the same ``ValueError`` on every rank of ``group`` if any rank found a ``problem`` or the ranks'
    ``fields`` (name -> value: shapes, options, layout and packing keys) differ
    (:func:`burstattn.comm.agree.agree`, op ``meta`` in the byte meter)."""
    agree(fn, entries(fields), group, problem=problem, stats=active_stats())


def _common_problem(x: torch.Tensor, chunk_size, layout, cu_seqlens, world: int) -> Optional[str]:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        return f"chunk_size must be a positive int, got {chunk_size!r}"
    if not x.is_floating_point():
        return f"inputs must be floating point, got {x.dtype}"
    if x.dim() < 3 or x.shape[1] < 1:
        return f"inputs must be [batch, local_seq, heads, ...] with local_seq >= 1, got {tuple(x.shape)}"
    try:
        check_layout(layout)
        if cu_seqlens is not None:
            _check_cu_seqlens(cu_seqlens, x.shape[1] * world)
    except (TypeError, ValueError) as e:
        return str(e)
    return None


def _slots_batch(x: torch.Tensor, offsets: torch.Tensor, length: int, tiles: bool = False) -> torch.Tensor:
    """``x [B, n, ...]`` -> ``[S * B, L, ...]``: the ``S`` segments starting at ``offsets``, stacked (a view
    when ``tiles``, the segments cover ``x`` in order, and ``B == 1``: no copy for the recurrence to keep)."""
    S = offsets.numel()
    if tiles and (S == 1 or x.shape[0] == 1):
        return x.reshape(x.shape[0] * S, length, *x.shape[2:])
    idx = (offsets.unsqueeze(1) + torch.arange(length)).flatten().to(x.device)  # [S * L]
    y = x.index_select(1, idx).view(x.shape[0], offsets.numel(), length, *x.shape[2:])  # [B, S, L, ...]
    return y.transpose(0, 1).reshape(offsets.numel() * x.shape[0], length, *x.shape[2:])


def state_passing(fn: str, tensors: dict, local: Callable, *, dv: int, a_shape: tuple, group, layout,
                  cu_seqlens, output_final_state: bool, fields: dict, problem: Optional[str], check: bool,
                  scheme: str = "auto", initial_state: Optional[torch.Tensor] = None):
    """The scheme for any recurrence: ``local(**segment_tensors) -> (o0, corr, A, B)``.

    Args:
        tensors: name -> ``[B, n, H, ...]`` local inputs (already in the compute dtype).
        local: per batch of equal-length segments ``[b, L, H, ...]``, returns ``o0 [b, L, H, dv]``,
            ``corr [b, L, H, dk]``, ``A [b, H, *a_shape]`` and ``B [b, H, dk, dv]``.
        a_shape: ``(dk, dk)`` for a matrix transition, ``()`` for a scalar decay.
        scheme: ``"allgather"``, ``"scan"`` or ``"auto"`` (:func:`~.schemes.resolve_scheme`).
        initial_state: ``[B, H, dk, dv]`` (the state before position 0, equal on every rank) or ``None``.
    Returns:
        ``(o [B, n, H, dv], final state [B, H, dk, dv] or None)``.
    """
    ctx = group_context(group)
    layout = layout_or_default(layout)
    if check:
        check_every_rank(fn, fields, problem, ctx.group)
    elif problem:
        raise ValueError(f"{fn}: {problem}")
    first = next(iter(tensors.values()))
    Bt, n, H = first.shape[:3]
    scheme = resolve_scheme(scheme, ctx.world_size)
    with host_side():  # plans are host bookkeeping, also inside the dry run's fake mode
        plan = segment_plan(n * ctx.world_size, ctx.world_size, layout, cu_seqlens)
        rt = route(plan, scheme, output_final_state)
    offs, lens = plan.offsets[ctx.rank], plan.lengths[ctx.rank]
    with host_side():  # [(length, its slots)]: segments of one length run as one batch
        groups = [(L, torch.nonzero(lens == L).flatten().tolist()) for L in sorted(set(lens.tolist()))]
        tiles = len(groups) == 1 and offs.tolist() == list(range(0, n, groups[0][0]))
    pieces, summaries = [], {}
    for L, pick in groups:
        starts = offs[pick]
        batch = {k: _slots_batch(t, starts, L, tiles) for k, t in tensors.items()}
        o0, corr, A, Bs = local(**batch)
        ns = len(pick)
        for j, i in enumerate(pick):
            summaries[i] = (A.view(ns, Bt, *A.shape[1:])[j], Bs.view(ns, Bt, *Bs.shape[1:])[j])
        pieces.append((pick, starts, L, o0.view(ns, Bt, L, H, -1), corr.view(ns, Bt, L, H, -1)))
    dk = pieces[0][4].shape[-1]
    pk = Packer(Bt, H, a_shape, dk, dv)
    token = summaries[0][1].reshape(-1)[0] * 0  # orders the rounds' backward (.comm); has a gradient iff needed
    S0 = None if initial_state is None else initial_state.to(first.dtype)
    if S0 is not None and S0.requires_grad and ctx.world_size > 1:
        token, S0 = sum_grad(token, S0, ctx.group, "state")  # its whole gradient on every rank
    fold = fold_scan if scheme == "scan" else fold_allgather
    before, S, tie = fold(rt, ctx, summaries, pk, final=output_final_state, initial=S0, token=token)
    outs, index = [], []
    zero = torch.zeros(Bt, H, dk, dv, dtype=first.dtype, device=first.device)
    for pick, starts, L, o0, corr in pieces:
        S_in = torch.stack([zero if before[i] is None else before[i] for i in pick])  # [ns, B, H, dk, dv]
        o = o0 + torch.einsum("sblhk,sbhkv->sblhv", corr, S_in)
        outs.append(o.transpose(0, 1).reshape(Bt, len(pick) * L, H, dv))
        index.append((starts.unsqueeze(1) + torch.arange(L)).flatten())
    order = torch.argsort(torch.cat(index)).to(first.device)
    out = torch.cat(outs, dim=1).index_select(1, order)
    if tie is not None:
        out = out + tie
    if S0 is not None and S0.requires_grad and ctx.world_size > 1:
        out = out + S0.reshape(-1)[0] * 0  # every rank joins the initial state's all-reduce
    final = None
    if output_final_state:
        final = S if ctx.rank == plan.last_owner else S.detach()
    return out, final


def _fields(kind: str, q, v, chunk_size, scale, layout, cu_seqlens, problem, **extra) -> dict:
    """What must agree across ranks (shapes, options, layout and packing checksums)."""
    ok = problem is None
    return dict(kind=kind, batch=dim(q, 0), local_seq=dim(q, 1), q_heads=dim(q, -2), v_heads=dim(v, -2),
                head_dim=dim(q, -1), v_head_dim=dim(v, -1),
                chunk_size=chunk_size if isinstance(chunk_size, int) else -1, dtype=str(getattr(q, "dtype", "")),
                scale=scale, layout=_layout_key(layout_or_default(layout)) if ok else None,
                cu_seqlens=_cu_key(cu_seqlens) if ok else None, **extra)


def _grouped(q, k, v, **rest) -> dict:
    """The inputs in the compute dtype, q and k repeated to v's heads (grouped heads)."""
    dtype = accum_dtype(q.dtype)
    rep = v.shape[2] // k.shape[2]
    q, k = (x.repeat_interleave(rep, dim=2) if rep > 1 else x for x in (q, k))
    return {name: t.to(dtype) for name, t in dict(q=q, k=k, v=v, **rest).items()}


def _delta_local(chunk_size: int, scale, use_qk_l2norm: bool):
    """Per batch of segments ``[b, L, H, ...]``: ``(o0, corr, A, B)`` by the chunked delta rule with ``dk``
    identity columns next to ``v``, one block of chunks at a time (:func:`.chunk_scan.block_scan`: the
    backward keeps only the block-boundary states and recomputes inside a block)."""
    def local(q, k, v, g, beta):
        b, L, H, dk = k.shape
        dv = v.shape[-1]
        C = min(chunk_size, L)

        def block(carry, q, k, v, g, beta):
            v_aug = torch.cat([v, v.new_zeros(*v.shape[:-1], dk)], -1)  # identity columns carry the transition
            o, S = chunk_delta_rule(q, k, v_aug, g, beta, chunk_size=C, initial_state=carry[0], scale=scale,
                                    use_qk_l2norm=use_qk_l2norm)
            return (o[..., :dv], o[..., dv:]), (S,)

        init = torch.cat([v.new_zeros(b, H, dk, dv), torch.eye(dk, dtype=v.dtype, device=v.device).expand(
            b, H, dk, dk)], -1)  # [b, H, dk, dv + dk]: [0 | I]
        (o0, corr), (S,) = block_scan(block, (init,), (q, k, v, g, beta), block=C * BLOCK_CHUNKS)
        return o0, corr, S[..., dv:], S[..., :dv]
    return local


def sp_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        *, group=None, layout="zigzag", cu_seqlens=None, chunk_size: int = 64,
                        scale: Optional[float] = None, use_qk_l2norm: bool = False,
                        output_final_state: bool = False, initial_state: Optional[torch.Tensor] = None,
                        scheme: str = "auto", kernel: str = "auto", check: bool = True):
    """Sequence-parallel gated delta rule (Gated DeltaNet; KDA when ``g`` has a channel dim).

    Args:
        q, k: this rank's shard ``[B, n, Hk, dk]``; v: ``[B, n, Hv, dv]`` (``Hv % Hk == 0``: grouped heads).
        g: log decay ``[B, n, Hv]`` or per channel ``[B, n, Hv, dk]`` (KDA); beta: ``[B, n, Hv]``.
        group, layout: as the attention (``layout`` a name or a Partition; ``None``: zigzag).
        cu_seqlens: packed documents of the global sequence (``[D + 1]``, equal on every rank): the
            state restarts from zero at each document start.
        chunk_size, scale, use_qk_l2norm: as transformers' ``torch_chunk_gated_delta_rule``.
        output_final_state: also return the state after position ``N - 1``, ``[B, Hv, dk, dv]``.
        initial_state: the state before position 0, ``[B, Hv, dk, dv]``, the same on every rank
            (continuing a sequence: a previous call's final state); documents after the first start
            from zero. Its gradient is the whole gradient on every rank (not a part to be summed).
        scheme: how the segments' summaries travel: ``"allgather"`` (one collective; every rank holds
            ``P`` ranks' summaries), ``"scan"`` (a log-depth prefix scan over point-to-point rounds;
            memory does not grow with ``P``) or ``"auto"`` (the scan from
            :data:`~burstattn.recurrent.schemes.SCAN_MIN_WORLD` ranks on). The results are equal.
        kernel: what computes each segment: ``"torch"`` (the chunked form of :mod:`.chunked`, the
            reference), ``"fla"`` (flash-linear-attention's Triton kernel: CUDA tensors, the package
            importable) or ``"auto"`` (``"fla"`` where it can run, else ``"torch"``;
            :func:`~burstattn.recurrent.kernels.segment_backend`).
        check: exchange a small signature first so that bad or disagreeing inputs raise on every rank.
    Returns:
        ``(o [B, n, Hv, dv] in q's dtype, final state in the compute dtype or None)``.
    Raises:
        ValueError on every rank: an input that is not a floating-point tensor (or on another device),
        shapes, ``chunk_size``, layout, ``cu_seqlens``, ``scheme``, ``kernel`` or ``initial_state``
        invalid on any rank, or differing across ranks.
    """
    return delta_rule_op("sp_gated_delta_rule", None, q, k, v, g, beta, group=group, layout=layout,
                         cu_seqlens=cu_seqlens, chunk_size=chunk_size, scale=scale, use_qk_l2norm=use_qk_l2norm,
                         output_final_state=output_final_state, initial_state=initial_state, scheme=scheme,
                         kernel=kernel, check=check)


def delta_rule_op(fn: str, problem: Optional[str], q, k, v, g, beta, *, group, layout, cu_seqlens, chunk_size,
                  scale, use_qk_l2norm, output_final_state, initial_state, scheme, kernel, check):
    """:func:`sp_gated_delta_rule` under the name ``fn``, with a ``problem`` its caller found already
    (then no tensor is read but for the agreement's fields: every rank raises)."""
    ctx = group_context(group)
    if problem is None:
        problem = tensors_problem(dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state),
                                   optional=("initial_state",))
    if problem is None:
        problem = _common_problem(q, chunk_size, layout_or_default(layout), cu_seqlens, ctx.world_size)
    if problem is None:
        problem = _delta_problem(q, k, v, g, beta)
    if problem is None:
        problem = _passing_problem(q, v, q.shape[-1], scheme, initial_state)
    if problem is None:
        problem = kernel_problem(kernel, q.device, accum_dtype(q.dtype))
    fields = _fields("delta", q, v, chunk_size, scale, layout, cu_seqlens, problem, channel_decay=len(
        getattr(g, "shape", ())) == 4, l2norm=int(use_qk_l2norm), kernel=str(kernel), **_passing_fields(
        scheme, output_final_state, initial_state, q, k, v, g, beta))
    tensors, local = {}, None
    if not problem:
        tensors = _grouped(q, k, v, g=g, beta=beta)
        fla = resolve_kernel(kernel, q.device, accum_dtype(q.dtype), is_fake(q)) == "fla"
        local = fla_delta_local(scale, use_qk_l2norm) if fla else _delta_local(chunk_size, scale, use_qk_l2norm)
    out, final = state_passing(fn, tensors, local, dv=dim(v, -1), a_shape=(dim(k, -1), dim(k, -1)), group=group,
                               layout=layout, cu_seqlens=cu_seqlens, output_final_state=output_final_state,
                               fields=fields, problem=problem, check=check, scheme=scheme,
                               initial_state=initial_state)
    return out.to(q.dtype), final


def _passing_problem(q, v, dk: int, scheme, initial_state) -> Optional[str]:
    """``scheme`` and ``initial_state`` (``[batch, v_heads, dk, dv]``, floating point)."""
    if scheme not in SCHEMES:
        return f"scheme must be one of {SCHEMES}, got {scheme!r}"
    want = (q.shape[0], v.shape[2], dk, v.shape[-1])
    if initial_state is not None and (not isinstance(initial_state, torch.Tensor) or
                                      not initial_state.is_floating_point() or tuple(initial_state.shape) != want):
        got = tuple(initial_state.shape) if isinstance(initial_state, torch.Tensor) else type(initial_state).__name__
        return f"initial_state must be a floating-point tensor of shape {list(want)} (batch, heads, dk, dv), got {got}"
    return None


def _passing_fields(scheme, final: bool, initial_state, *inputs) -> dict:
    """What must agree for the messages to match: the scheme, the final state, whether an initial
    state and gradients take part."""
    grad = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                            for t in (*inputs, initial_state))
    init = 0 if initial_state is None else 1 + int(isinstance(initial_state, torch.Tensor) and
                                                    initial_state.requires_grad and torch.is_grad_enabled())
    return dict(scheme=scheme, output_final_state=int(bool(final)), initial_state=init, grad=int(grad))


def _delta_problem(q, k, v, g, beta) -> Optional[str]:
    if q.dim() != 4 or k.shape != q.shape:
        return f"q and k must be [batch, local_seq, heads, head_dim] of one shape, got {tuple(q.shape)} and " \
               f"{tuple(k.shape)}"
    B, n, Hk, dk = k.shape
    if v.dim() != 4 or v.shape[:2] != (B, n) or v.shape[2] % Hk:
        return f"v must be [batch, local_seq, v_heads, v_head_dim] with v_heads a multiple of {Hk}, got " \
               f"{tuple(v.shape)}"
    Hv = v.shape[2]
    if tuple(g.shape) not in ((B, n, Hv), (B, n, Hv, dk)):
        return f"g must be [{B}, {n}, {Hv}] or [{B}, {n}, {Hv}, {dk}] (per channel), got {tuple(g.shape)}"
    if tuple(beta.shape) != (B, n, Hv):
        return f"beta must be [{B}, {n}, {Hv}], got {tuple(beta.shape)}"
    return None


def _linear_local(chunk_size: int, scale: float):
    """Per batch of segments: ``(o0, corr = scale q exp(G_t), A = exp(G_L), B)``, one block of chunks at a
    time (:func:`.chunk_scan.block_scan`), the running log decay ``G`` carried with the state."""
    def local(q, k, v, g):
        C = min(chunk_size, k.shape[1])

        def block(carry, q, k, v, g):
            S, G0 = carry
            o, S = chunk_linear_attention(q, k, v, g, chunk_size=C, initial_state=S, scale=scale)
            G = G0.unsqueeze(1) + g.cumsum(1)  # [b, l, H]: log decay from the segment's start through each token
            return (o, q * scale * G.exp().unsqueeze(-1)), (S, G[:, -1])

        b, L, H, dk = k.shape
        init = (q.new_zeros(b, H, dk, v.shape[-1]), q.new_zeros(b, H))
        (o, corr), (S, G) = block_scan(block, init, (q, k, v, g), block=C * BLOCK_CHUNKS)
        return o, corr, G.exp(), S
    return local


def sp_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, *, group=None,
                        layout="zigzag", cu_seqlens=None, chunk_size: int = 64, scale: float = 1.0,
                        output_final_state: bool = False, initial_state: Optional[torch.Tensor] = None,
                        scheme: str = "auto", kernel: str = "auto", check: bool = True):
    """Sequence-parallel linear attention with a scalar decay (SSD, lightning attention).

    ``S_t = exp(g_t) S_{t-1} + k_t v_t^T``, ``o_t = scale * q_t @ S_t``.

    Args:
        q, k: ``[B, n, Hk, dk]``; v: ``[B, n, H, dv]`` (``H % Hk == 0``); g: ``[B, n, H]`` log decay.
        initial_state: ``[B, H, dk, dv]`` or ``None``. Others as :func:`sp_gated_delta_rule`
            (``kernel="fla"``: flash-linear-attention's ``chunk_simple_gla``).
    Returns:
        ``(o [B, n, H, dv], final state [B, H, dk, dv] or None)``.
    Raises:
        ValueError on every rank, as :func:`sp_gated_delta_rule`.
    """
    return linear_attention_op("sp_linear_attention", None, q, k, v, g, group=group, layout=layout,
                               cu_seqlens=cu_seqlens, chunk_size=chunk_size, scale=scale,
                               output_final_state=output_final_state, initial_state=initial_state, scheme=scheme,
                               kernel=kernel, check=check)


def linear_attention_op(fn: str, problem: Optional[str], q, k, v, g, *, group, layout, cu_seqlens, chunk_size,
                        scale, output_final_state, initial_state, scheme, kernel, check, extra: Optional[dict] = None):
    """:func:`sp_linear_attention` under the name ``fn``, with a ``problem`` its caller found already and
    ``extra`` fields that must agree across ranks (the caller's own options)."""
    ctx = group_context(group)
    if problem is None:
        problem = tensors_problem(dict(q=q, k=k, v=v, g=g, initial_state=initial_state), optional=("initial_state",))
    if problem is None:
        problem = _common_problem(q, chunk_size, layout_or_default(layout), cu_seqlens, ctx.world_size)
    if problem is None:
        problem = _delta_problem(q, k, v, g, g if g.dim() == 3 else g[..., 0])
        if problem is None and g.dim() != 3:
            problem = f"g must be [batch, local_seq, heads] (a scalar decay), got {tuple(g.shape)}"
    if problem is None:
        problem = _passing_problem(q, v, q.shape[-1], scheme, initial_state)
    if problem is None:
        problem = kernel_problem(kernel, q.device, accum_dtype(q.dtype))
    fields = _fields("linear", q, v, chunk_size, scale, layout, cu_seqlens, problem, kernel=str(kernel),
                     **(extra or {}), **_passing_fields(scheme, output_final_state, initial_state, q, k, v, g))
    tensors, local = {}, None
    if not problem:
        tensors = _grouped(q, k, v, g=g)
        fla = resolve_kernel(kernel, q.device, accum_dtype(q.dtype), is_fake(q)) == "fla"
        local = fla_linear_local(scale) if fla else _linear_local(chunk_size, scale)
    out, final = state_passing(fn, tensors, local, dv=dim(v, -1), a_shape=(), group=group, layout=layout,
                               cu_seqlens=cu_seqlens, output_final_state=output_final_state, fields=fields,
                               problem=problem, check=check, scheme=scheme, initial_state=initial_state)
    return out.to(q.dtype), final

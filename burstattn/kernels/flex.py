"""A masked block pair in one FlexAttention call (:class:`FlexPair`): ``mask_mod`` and mixed masks on CUDA.

The pair's ``BlockMask`` comes from the ``AttnMask``'s block summary (tile classes at its ``block_size``,
:func:`burstattn.masks.blocks.classify`): full tiles are flex's full blocks (no mask evaluated), causal,
strict and partial tiles its partial blocks, empty tiles are skipped (:func:`block_tables`). The mask
function reads the pair's global positions: key ``j`` is visible to query ``i`` iff it lies in the row's
interval ``[lo_i, hi_i]`` (causal, window, documents) and ``mask_mod(q_pos_i, k_pos_j)`` holds.

Forward: compiled ``flex_attention`` with its log-sum-exp returned for the merge. Backward: the engine
needs the gradient under the *global* softmax (``P = exp(S - lse)``, ``D = rowsum(dO * O)``), while flex
differentiates its own block; the two agree through the merge's own derivative: with
``w = exp(lse_j - lse)``, the block's ``(o_j, lse_j)`` get ``grad_o = w dO`` and
``grad_lse = w (rowsum(dO * o_j) - D)``, and flex's backward (which takes a log-sum-exp gradient) then
gives exactly the global gradients of the block (:func:`block_grads`). It costs one more flex forward per
pair in the backward. Where flex cannot run (no CUDA: a step modelled on CUDA with real CPU tensors, the
tests), a dense masked attention in plain PyTorch stands in, with the same block grads.
"""
from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..config import accum_dtype
from .pair import on_device


@dataclass(frozen=True)
class FlexSpec:
    """One pair's block mask inputs (host tensors): tile tables ``[1, 1, Tq, Tk]`` (int32), the rows'
    positions and intervals padded to whole tiles, the user's ``mask_mod`` (``None``: intervals only)."""

    kv_num: torch.Tensor
    kv_idx: torch.Tensor
    full_num: torch.Tensor
    full_idx: torch.Tensor
    block: int
    n_q: int
    n_k: int
    q_pos: torch.Tensor
    k_pos: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    mask_mod: Optional[Callable] = None


def block_tables(cls: torch.Tensor, full: int = 1, empty: int = 0) -> tuple[torch.Tensor, ...]:
    """Flex's ``(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)`` (int32, ``[1, 1, Tq]``
    and ``[1, 1, Tq, Tk]``) from tile classes ``cls [Tq, Tk]``: class ``full`` -> full blocks, ``empty``
    -> none, any other -> partial blocks (the mask evaluated). Indices of each row in increasing order,
    the rest of the row 0 (flex reads only the first ``num`` entries)."""
    tq, tk = cls.shape
    tables = []
    for sel in (lambda c: (c != empty) & (c != full), lambda c: c == full):
        chosen = sel(cls)
        num = chosen.sum(1).to(torch.int32)
        idx = torch.zeros(tq, tk, dtype=torch.int32)
        for i in range(tq):
            cols = torch.nonzero(chosen[i]).flatten().to(torch.int32)
            idx[i, :cols.numel()] = cols
        tables += [num.view(1, 1, tq), idx.view(1, 1, tq, tk)]
    return tuple(tables)


def _padded(x: torch.Tensor, n: int, value: int) -> torch.Tensor:
    out = torch.full((n,), value, dtype=torch.int64)
    out[:x.numel()] = x
    return out


def flex_spec(cls: torch.Tensor, block: int, q_pos: torch.Tensor, k_pos: torch.Tensor, lo: torch.Tensor,
              hi: torch.Tensor, mask_mod: Optional[Callable]) -> FlexSpec:
    """A pair's :class:`FlexSpec` from its tile classes (``burstattn.masks.blocks`` constants: EMPTY 0,
    FULL 1) and its rows' positions and intervals ``[n_q]`` (keys ``[n_k]``); padded rows see nothing."""
    tq, tk = cls.shape
    kv_num, kv_idx, full_num, full_idx = block_tables(cls)
    nq, nk = q_pos.numel(), k_pos.numel()
    return FlexSpec(kv_num, kv_idx, full_num, full_idx, block, nq, nk, _padded(q_pos, tq * block, 0),
                    _padded(k_pos, tk * block, 0), _padded(lo, tq * block, 1), _padded(hi, tq * block, 0), mask_mod)


def _mask_fn(qp, kp, lo, hi, user: Optional[Callable]) -> Callable:
    def mask(b, h, qi, ki):
        key = kp[ki]
        ok = (key >= lo[qi]) & (key <= hi[qi])
        return ok & user(qp[qi], key) if user is not None else ok
    return mask


@dataclass(frozen=True)
class FlexSlot:
    """One mask function per mask, device and padded shape, reading the positions and intervals of whichever
    pair was loaded into its tensors last (:func:`flex_slot`): the compiled flex kernel sees the same function
    for every pair (a new function object per pair would recompile it per pair)."""

    tensors: tuple
    fn: Callable


def flex_slot(store: dict, spec: FlexSpec, device) -> FlexSlot:
    """The :class:`FlexSlot` of ``spec``'s mask, device and shape (kept in ``store``), loaded with ``spec``'s
    positions and intervals."""
    key = ("flex_slot", str(device), spec.q_pos.numel(), spec.k_pos.numel(), id(spec.mask_mod))
    slot = store.get(key)
    if slot is None:
        tensors = tuple(torch.empty_like(x, device=device) for x in (spec.q_pos, spec.k_pos, spec.lo, spec.hi))
        slot = store[key] = FlexSlot(tensors, _mask_fn(*tensors, spec.mask_mod))
    for dst, src in zip(slot.tensors, (spec.q_pos, spec.k_pos, spec.lo, spec.hi)):
        dst.copy_(src)
    return slot


def block_mask(spec: FlexSpec, device, store: Optional[dict] = None):
    """The pair's ``torch.nn.attention.flex_attention.BlockMask`` (its mask function from ``store``'s slot,
    :func:`flex_slot`; a fresh store without one)."""
    from torch.nn.attention.flex_attention import BlockMask

    slot = flex_slot({} if store is None else store, spec, device)
    return BlockMask.from_kv_blocks(spec.kv_num.to(device), spec.kv_idx.to(device), spec.full_num.to(device),
                                    spec.full_idx.to(device), BLOCK_SIZE=(spec.block, spec.block),
                                    mask_mod=slot.fn, seq_lengths=(spec.n_q, spec.n_k))


@functools.lru_cache(maxsize=1)
def compiled_flex():
    """``torch.compile(flex_attention)``, made once per process (the flex kernels are only fast compiled)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_call(fn, q, k, v, bm, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of one flex call ``fn`` (the compiled or the eager ``flex_attention``), whichever
    spelling of the log-sum-exp this PyTorch has (``return_aux`` from 2.9, ``return_lse`` before)."""
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:
        return fn(q, k, v, block_mask=bm, scale=scale, enable_gqa=True, return_lse=True)
    out, aux = fn(q, k, v, block_mask=bm, scale=scale, enable_gqa=True, return_aux=AuxRequest(lse=True))
    return out, aux.lse


def dense_reference(spec: FlexSpec, q, k, v, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """What the flex call computes, densely in plain PyTorch (differentiable; float32, float64 for float64):
    ``out [B, h, n_q, Dv]`` (q's dtype) and ``lse [B, h, n_q]`` (``-inf`` where a row sees nothing)."""
    acc = accum_dtype(q.dtype)
    nq, nk = spec.n_q, spec.n_k
    fn = _mask_fn(*(x.to(q.device) for x in (spec.q_pos, spec.k_pos, spec.lo, spec.hi)), spec.mask_mod)
    vis = fn(0, 0, torch.arange(nq, device=q.device)[:, None], torch.arange(nk, device=q.device)[None, :])
    g = q.shape[1] // k.shape[1]
    ke, ve = (x.to(acc).repeat_interleave(g, dim=1) for x in (k, v))
    s = (torch.matmul(q.to(acc), ke.transpose(-1, -2)) * scale).masked_fill(~vis, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.masked_fill(lse == -math.inf, 0).unsqueeze(-1))
    return torch.matmul(p, ve).to(q.dtype), lse


@contextlib.contextmanager
def autograd_on():
    """Autograd recording on, inside a custom op's kernel too: the op's dispatch excludes the autograd keys
    below it (grad mode alone does not bring them back), so :func:`block_grads` lifts that exclusion for
    its own recomputation, and grad mode with it."""
    inc, exc = torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set()
    for key in (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.ADInplaceOrView,
                torch._C.DispatchKey.AutogradOther):
        exc = exc.remove(key)
    with torch._C._ForceDispatchKeyGuard(inc, exc), torch.enable_grad():
        yield


def block_grads(fwd: Callable, dout, q, k, v, out, lse) -> tuple[torch.Tensor, ...]:
    """``dq, dk, dv`` of one block under the global softmax (see the module docstring): ``fwd(q, k, v) ->
    (o_j, lse_j)`` differentiable; ``dout, out [B, h, n, Dv]`` and ``lse [B, h, n]`` the rows' global ones
    (huge for rows that see nothing anywhere)."""
    with autograd_on():
        qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
        o_j, lse_j = fwd(qg, kg, vg)
        seen = lse_j > -math.inf
        w = torch.exp((lse_j.float() - lse.float()).masked_fill(~seen, -math.inf))  # [B, h, n]
        delta = (dout.float() * out.float()).sum(-1)
        grad_o = (w.unsqueeze(-1) * dout.float()).to(o_j.dtype)
        grad_lse = (w * ((dout.float() * o_j.detach().float()).sum(-1) - delta)).masked_fill(~seen, 0.0)
        return torch.autograd.grad([o_j, lse_j], [qg, kg, vg], [grad_o, grad_lse.to(lse_j.dtype)])


class FlexPair:
    """One masked pair as one compiled FlexAttention call on CUDA (a fake tensor: its shape function); the
    dense reference elsewhere. ``store``: where the mask functions live (:func:`flex_slot`; the mask
    object's cache, so every call of the mask reuses them)."""

    kernel = "flex"

    def __init__(self, store: Optional[dict] = None) -> None:
        self.store = {} if store is None else store

    def _fwd(self, spec: FlexSpec, scale: float):
        def fwd(q, k, v):
            if not on_device(q):
                return dense_reference(spec, q, k, v, scale)
            return flex_call(compiled_flex(), q, k, v, block_mask(spec, q.device, self.store), scale)
        return fwd

    def forward(self, spec: FlexSpec, q, k, v, scale: float):
        """``(rows, out [B, h, n_q, Dv], lse [B, h, n_q])`` of the whole pair."""
        out, lse = self._fwd(spec, scale)(q, k, v)
        return slice(0, spec.n_q), out, lse

    def backward(self, spec: FlexSpec, dout, q, k, v, out, lse, scale: float):
        """``(rows, keys, dq, dk, dv)`` of the whole pair (:func:`block_grads`)."""
        dq, dk, dv = block_grads(self._fwd(spec, scale), dout, q, k, v, out, lse)
        return slice(0, spec.n_q), slice(0, spec.n_k), dq, dk, dv

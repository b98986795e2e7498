"""What a block pair computes, each pass written once: forward and backward over any plan (ring, direct,
nested, local): the kernel calls of a pair, the accumulators, the query side and the K/V message.

Which data travels (K/V: RingAttention's backward; the query side: BurstAttention's) is the plan's
choice; a pass only says what a pair computes and how partials accumulate:

* forward: ``out, lse`` of the queries' owner, merged by the one log-sum-exp merge (float32;
  float64 for float64 inputs). The query side is ``(q,)``; a partial sent back (DistFlashAttn's
  helper, pass-Q's partials) is ``(lse, out)``, the output in q's dtype or the accumulators'.
* backward: dQ for the queries' owner, dK/dV for the keys' owner (float32 accumulators). The query
  side is :func:`query_side`: ``(q, dO, [LSE; D])`` with ``D = rowsum(dO * O)``; a remote query
  block rebuilds an ``O'`` with the same ``D`` (:func:`pseudo_out`) instead of shipping O.

K and V travel as one message (:class:`KVPack`) at their own head sizes. Tensors here are
``[B, H, n, D]`` (one head group: :mod:`.run` runs the groups one after another).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch

from ..config import accum_dtype
from ..kernels.base import CHUNK_ELEMENTS, ROW_CHUNK, Kernel, ScoreMods, chunk_rows, row_dot
from .loop import Partial, Whole
from .merge import merge_
from .pairs import BlockOp, MaskKind, tile_op
from .plan import Key

BLIND_LSE = 1e30  # exp(s - 1e30) == 0 in float32 and float64; finite, so no kernel forms inf - inf
FP32_TILE = ROW_CHUNK  # the fewest rows and keys per kernel call when the backward runs on float32 copies
LOW_PRECISION = (torch.float16, torch.bfloat16)


def op_slices(op: BlockOp) -> Optional[tuple[slice, slice, bool]]:
    """Kernel call for a block op: (query rows, key rows, causal); ``None`` if empty.

    ``STRICT`` (key j visible iff j < i) is the causal kernel on queries ``1..`` and keys
    ``..-1``; query row 0 of such a block sees nothing and is left out.
    """
    if op.mask is MaskKind.STRICT:
        if op.q_stop - op.q_start < 2:
            return None
        return slice(op.q_start + 1, op.q_stop), slice(op.k_start, op.k_stop - 1), True
    return slice(op.q_start, op.q_stop), slice(op.k_start, op.k_stop), op.mask is MaskKind.CAUSAL


def backward_lse(lse: torch.Tensor) -> torch.Tensor:
    """LSE with ``-inf`` (rows that see nothing) replaced by a huge finite value: P = 0 there."""
    return lse.masked_fill(lse == float("-inf"), BLIND_LSE)


def query_side(q: torch.Tensor, dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> tuple:
    """The backward's query side of one query block: ``(q, dout, [LSE'; D])`` with ``LSE'`` =
    :func:`backward_lse` and ``D = rowsum(dout * out)`` (:func:`~burstattn.kernels.base.row_dot`, in
    ``lse``'s dtype). ``q [B, h, n, D]``, ``dout, out [B, h, n, Dv]``, ``lse [B, h, n]`` -> the third
    entry ``[2, B, h, n]``. What travels on the query ring and what a local plan starts from."""
    return q, dout, torch.stack([backward_lse(lse), row_dot(dout, out, lse.dtype)])


def pseudo_out(dout: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """A tensor ``O'`` with ``rowsum(dout * O') == delta``: ``dout * delta / |dout|^2``.

    The fused kernels take the output only to form D = rowsum(dO * O); the query side ships
    D (one scalar per row) instead of O (head_dim values per row) and rebuilds an equivalent
    O' on arrival. Rows with dO == 0 have D == 0 and get O' == 0. Computed in ``delta``'s dtype
    a chunk of rows at a time; the result has dout's dtype.
    """
    out = torch.empty_like(dout)
    step = chunk_rows(dout.numel() // max(dout.shape[2], 1))
    for i in range(0, dout.shape[2], step):
        rows = slice(i, i + step)
        df = dout[:, :, rows].to(delta.dtype)
        norm = (df * df).sum(-1, keepdim=True)
        scale = torch.where(norm > 0, delta[:, :, rows].unsqueeze(-1) / norm, torch.zeros_like(norm))
        out[:, :, rows] = df * scale  # df may be a view of dout (same dtype): never in place
    return out


@dataclass(frozen=True)
class KVPack:
    """K ``[B, h, n, D]`` and V ``[B, h, n, Dv]`` as ONE message: stacked ``[2, B, h, n, D]`` when
    ``D == Dv``, else one flat buffer (each at its own size: no padding on the wire)."""

    k_shape: tuple
    v_shape: tuple

    def pack(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One copy of ``k`` and ``v`` (any strides) into the message."""
        if self.k_shape == self.v_shape:
            return torch.stack([k, v])
        nk = k.numel()
        buf = torch.empty(nk + v.numel(), dtype=k.dtype, device=k.device)
        buf[:nk].view(self.k_shape).copy_(k)
        buf[nk:].view(self.v_shape).copy_(v)
        return buf

    def payload_split(self, payload: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k, v)`` views of a payload ``(message,)`` (what the loop holds for a K/V block)."""
        return self.split(payload[0])

    def split(self, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k, v)`` views of a message."""
        if self.k_shape == self.v_shape:
            return buf[0], buf[1]
        nk = 1
        for s in self.k_shape:
            nk *= s
        return buf[:nk].view(self.k_shape), buf[nk:].view(self.v_shape)


@dataclass
class BlockCalls:
    """Kernel calls of block ops: FULL / CAUSAL / STRICT run the kernel's own modes; PARTIAL ops
    (masks only) an explicit bool mask ``mask_of(op, q_owner, k_owner) -> [q rows, k rows]``, on
    ``fallback`` when ``kernel`` takes no mask (flash-attn -> sdpa).

    ``mods``: the call's score modifiers (softcap, ALiBi slopes of this head group); with ALiBi,
    ``positions = (q_pos, k_pos)``: every owner's aligned query and key positions. ``fp32_grads``:
    16-bit backwards run on float32 copies of one tile at a time (:meth:`tile`: square, each side's
    float32 copy at most ``tile_elements``, at least :data:`FP32_TILE` rows), on ``grad_kernel`` when
    ``kernel`` takes no float32, so every dQ/dK/dV partial is float32 from the start (nothing rounded
    to 16 bits before the accumulation).

    ``pair_kernel`` / ``pair_spec``: a masked pair in ONE kernel call per rule (the GPU's path,
    :mod:`burstattn.kernels.policy`): ``pair_spec(q_owner, k_owner)`` is what the kernel takes for the pair
    (``None``: the pair runs its block ops), ``pair_kernel.forward(spec, q, k, v, scale) -> (rows, out_j,
    lse_j)`` and ``.backward(spec, dout, q, k, v, out, lse, scale) -> (rows, keys, dq_j, dk_j, dv_j)``."""

    kernel: Kernel
    scale: float
    mask_of: Optional[Callable] = None
    fallback: Optional[Kernel] = None
    mods: Optional[ScoreMods] = None
    positions: Optional[tuple] = None
    fp32_grads: bool = False
    grad_kernel: Optional[Kernel] = None
    tile_elements: int = CHUNK_ELEMENTS
    pair_kernel: Optional[object] = None
    pair_spec: Optional[Callable] = None

    def spec_of(self, pair) -> Optional[object]:
        """The one-call kernel's input for ``pair`` (``None``: its block ops run)."""
        if self.pair_kernel is None or not pair.ops:
            return None
        return self.pair_spec(pair.q, pair.k)

    def tile(self, q: torch.Tensor, v: torch.Tensor) -> int:
        """Rows and keys of a float32 tile for ``q [B, h, n, D]``, ``v [..., Dv]``: a tile's widest
        copy (its queries, or its keys at the query heads a kernel may expand them to) holds at
        most ``tile_elements`` elements."""
        b, h, _, d = q.shape
        return chunk_rows(b * h * max(d, v.shape[-1]), self.tile_elements)

    def heads(self, hs: slice) -> "BlockCalls":
        """The calls of the query heads ``hs`` (ALiBi slopes sliced)."""
        if self.mods is None or self.mods.alibi is None:
            return self
        return replace(self, mods=replace(self.mods, alibi=self.mods.alibi[:, hs]))

    def _mods(self, qs: slice, ks: slice, q_owner: int, k_owner: int) -> Optional[ScoreMods]:
        if self.mods is None or self.mods.alibi is None:
            return self.mods
        qp, kp = self.positions
        return ScoreMods(self.mods.softcap, self.mods.alibi, qp[q_owner][qs], kp[k_owner][ks])

    def _call(self, op: BlockOp, q_owner: int, k_owner: int, device):
        if op.mask is not MaskKind.PARTIAL:
            sl = op_slices(op)
            return None if sl is None else (*sl, self.kernel, None)
        m = self.mask_of(op, q_owner, k_owner).to(device)
        kern = self.kernel if self.kernel.supports_mask else self.fallback
        return slice(op.q_start, op.q_stop), slice(op.k_start, op.k_stop), False, kern, m

    def forward(self, op: BlockOp, q, k, v, q_owner: int, k_owner: int):
        """``(q rows, out_j, lse_j)`` of one op (``None`` if it computes nothing)."""
        c = self._call(op, q_owner, k_owner, q.device)
        if c is None:
            return None
        qs, ks, causal, kern, m = c
        o_j, lse_j = kern.forward(q[:, :, qs], k[:, :, ks], v[:, :, ks], self.scale, causal, mask=m,
                                  mods=self._mods(qs, ks, q_owner, k_owner))
        if m is not None:
            blind = ~m.any(1)  # rows of this block that see none of its keys
            if bool(blind.any()):
                lse_j = lse_j.masked_fill(blind, float("-inf"))
                o_j = o_j.masked_fill(blind[:, None], 0.0)
        return qs, o_j, lse_j

    def backward(self, ops, dout, q, k, v, out, lse, q_owner: int, k_owner: int):
        """Yield ``(q rows, k rows, dq_j, dk_j, dv_j)`` per op or tile (``lse``: huge for blind rows)."""
        upcast = self.fp32_grads and q.dtype in LOW_PRECISION
        size = self.tile(q, v) if upcast else 0
        for op in ops:
            for tile in (tile_op(op, size) if upcast else (op,)):
                c = self._call(tile, q_owner, k_owner, q.device)
                if c is None:
                    continue
                qs, ks, causal, kern, m = c
                xs = (dout[:, :, qs], q[:, :, qs], k[:, :, ks], v[:, :, ks], out[:, :, qs])
                if upcast and not kern.fp32_grads:
                    kern = kern if kern.float32 else self.grad_kernel
                    xs = tuple(x.float() for x in xs)
                yield (qs, ks, *kern.backward(*xs, lse[:, :, qs], self.scale, causal, mask=m,
                                              mods=self._mods(qs, ks, q_owner, k_owner)))


def _full(rows: slice, n: int) -> bool:
    return rows.start == 0 and rows.stop == n


class ForwardAccs:
    """Forward accumulators: ``(out [B, h, n, Dv], lse [B, h, n])`` per query owner (accumulator
    dtype). A partial sent back travels as ``(lse, out)`` with ``out`` in ``wire`` (default: q's
    dtype)."""

    sides = frozenset({"q"})

    def __init__(self, q: torch.Tensor, v_head_dim: Optional[int] = None,
                 wire: Optional[torch.dtype] = None) -> None:
        b, h, n, d = q.shape
        self.shape = (b, h, n, d if v_head_dim is None else v_head_dim)
        self.dtype = q.dtype if wire is None else wire
        self.device = q.device
        self.acc = accum_dtype(q.dtype)

    def empty(self):
        b, h, n, d = self.shape
        return (torch.zeros(b, h, n, d, dtype=self.acc, device=self.device),
                torch.full((b, h, n), float("-inf"), dtype=self.acc, device=self.device))

    def fold(self, side, acc, c):
        if isinstance(c, Whole):
            return self.received(side, acc, (c.acc[1], c.acc[0]))
        rows, (o_j, lse_j) = c.rows, c.tensors
        if acc is None and _full(rows, self.shape[2]):  # the first partial covers every row: adopt it, in the
            return o_j.to(self.acc), lse_j.to(self.acc)  # kernel's own strides (made contiguous only to be sent)
        acc = self.empty() if acc is None else acc
        merge_(acc[0][:, :, rows], acc[1][:, :, rows], o_j, lse_j)
        return acc

    def wire(self, side, acc):
        out, lse = self.empty() if acc is None else acc
        return lse.contiguous(), out.to(self.dtype).contiguous()

    def like(self, side):
        b, h, n, d = self.shape
        return (torch.empty(b, h, n, dtype=self.acc, device=self.device),
                torch.empty(b, h, n, d, dtype=self.dtype, device=self.device))

    def received(self, side, acc, bufs):
        lse, out = bufs
        if acc is None:
            return out.to(self.acc), lse.to(self.acc)
        merge_(acc[0], acc[1], out, lse)
        return acc


class BackwardAccs:
    """Backward accumulators: ``(dq,)`` per query owner, ``(dk, dv)`` per key owner (shapes of q and
    of one owner's K and V blocks, ``[B, h, n, D]``)."""

    sides = frozenset({"q", "kv"})

    def __init__(self, q: torch.Tensor, k_shape: tuple, v_shape: tuple) -> None:
        self.acc = accum_dtype(q.dtype)
        self.shapes = {"q": [tuple(q.shape)], "kv": [tuple(k_shape), tuple(v_shape)]}
        self.device = q.device

    def zeros(self, side):
        return tuple(torch.zeros(s, dtype=self.acc, device=self.device) for s in self.shapes[side])

    def fold(self, side, acc, c):
        if isinstance(c, Whole):
            return self.received(side, acc, c.acc)
        rows, parts = c.rows, c.tensors
        n = self.shapes[side][0][2]
        if acc is None and _full(rows, n):  # the first partial covers every row: adopt it, in the kernel's
            return tuple(x.to(self.acc) for x in parts)  # own strides (made contiguous only to be sent: wire)
        acc = self.zeros(side) if acc is None else acc
        for a, x in zip(acc, parts):
            a[:, :, rows].add_(x)  # in place on the view (`+=` on an index also writes the view back)
        return acc

    def wire(self, side, acc):
        return self.zeros(side) if acc is None else tuple(x.contiguous() for x in acc)

    def like(self, side):
        return tuple(torch.empty(s, dtype=self.acc, device=self.device) for s in self.shapes[side])

    def received(self, side, acc, bufs):
        if acc is None:
            return tuple(x.to(self.acc) for x in bufs)
        for a, x in zip(acc, bufs):
            a.add_(x)
        return acc


def stacked_kv(payload: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k, v)`` of a payload ``([2, B, h, n, D],)``: K and V stacked in one message."""
    return payload[0][0], payload[0][1]


def held_kv(payload: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k, v)`` of a payload ``(k, v)``: a block that never travels, held as it is (no copy)."""
    return payload[0], payload[1]


def forward_compute(calls: BlockCalls, split: Callable = stacked_kv):
    """``compute`` of the forward: the queries of ``pair.q`` against the K/V of ``pair.k``
    (``split``: K/V payload -> ``(k, v)``: :func:`stacked_kv`, :func:`held_kv`, :meth:`KVPack.payload_split`)."""
    def compute(pair, data):
        q = data[Key("q", pair.q)][0]
        k, v = split(data[Key("kv", pair.k)])
        spec = calls.spec_of(pair)
        if spec is not None:  # the whole masked pair in one kernel call per rule
            rows, o_j, lse_j = calls.pair_kernel.forward(spec, q, k, v, calls.scale)
            yield Key("q", pair.q), Partial(rows, (o_j, lse_j))
            return
        for op in pair.ops:
            res = calls.forward(op, q, k, v, pair.q, pair.k)
            if res is not None:
                yield Key("q", pair.q), Partial(res[0], res[1:])
    return compute


def backward_compute(calls: BlockCalls, own_q: int, own_out: torch.Tensor, split: Callable = stacked_kv):
    """``compute`` of the backward. Query side ``(q, dO, [LSE; D])``; the owner ``own_q``'s rows use
    the real output ``own_out``, other owners' rows :func:`pseudo_out`."""
    def compute(pair, data):
        if not pair.ops:
            return
        q, dout, ld = data[Key("q", pair.q)]
        k, v = split(data[Key("kv", pair.k)])
        out = own_out if pair.q == own_q else pseudo_out(dout, ld[1])
        spec = calls.spec_of(pair)
        if spec is not None:
            qs, ks, dq_j, dk_j, dv_j = calls.pair_kernel.backward(spec, dout, q, k, v, out, ld[0], calls.scale)
            yield Key("q", pair.q), Partial(qs, (dq_j,))
            yield Key("kv", pair.k), Partial(ks, (dk_j, dv_j))
            return
        for qs, ks, dq_j, dk_j, dv_j in calls.backward(pair.ops, dout, q, k, v, out, ld[0], pair.q, pair.k):
            yield Key("q", pair.q), Partial(qs, (dq_j,))
            yield Key("kv", pair.k), Partial(ks, (dk_j, dv_j))
    return compute

"""One block pair's masked attention as varlen kernel calls (:class:`~.bands.BandCall`): the argument lists
of PyTorch's own CUDA kernels and a plain-PyTorch reference with their semantics.

* ``aten_flash``: ``torch.ops.aten._flash_attention_forward`` / ``_backward`` (16-bit; native GQA; the
  log-sum-exp out and in): ``cum_seq_q`` / ``cum_seq_k`` (int32), ``max_q`` / ``max_k``, ``is_causal``,
  ``window_size_left`` / ``_right``.
* ``aten_efficient``: ``_efficient_attention_forward`` / ``_backward`` (float32 too): ``cu_seqlens_q`` /
  ``_k``, ``custom_mask_type`` (0 none, 2 causal from the bottom right); K/V expanded to the query heads;
  its LSE is ``[segments, H, ceil(max_q / 32) * 32]``.

Packed tensors are ``[total, H, D]``: batch-major, each batch element's rows (keys) as the call's runs.
:func:`reference_forward` / :func:`reference_backward` compute what the flash kernels compute (flash's
window rule, :func:`~.bands.flash_window`; a row that sees nothing gets output 0 and LSE ``+inf``) in
plain PyTorch, in float32 (float64 for float64): the CPU's stand-in where a step is modelled on CUDA with
real CPU tensors, and the tests' check of the arguments. On a fake tensor (a dry run) the aten ops' own
shape functions run.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..config import accum_dtype
from .bands import BandCall, segment_ranges

FLASH_FWD = "_flash_attention_forward"
FLASH_BWD = "_flash_attention_backward"
EFF_FWD = "_efficient_attention_forward"
EFF_BWD = "_efficient_attention_backward"


def _index(runs: tuple, device) -> torch.Tensor:
    return torch.cat([torch.arange(a, b, device=device) for a, b in runs])


def pack(x: torch.Tensor, runs: tuple) -> torch.Tensor:
    """``x [B, h, n, D]`` -> ``[B * T, h, D]`` (contiguous copy) of the rows in ``runs`` (``T`` rows)."""
    if len(runs) == 1:
        part = x[:, :, runs[0][0]:runs[0][1]]
    else:
        part = x.index_select(2, _index(runs, x.device))
    b, h, t, d = part.shape
    return part.transpose(1, 2).reshape(b * t, h, d)


def unpack(y: torch.Tensor, batch: int) -> torch.Tensor:
    """``[B * T, h, D]`` -> ``[B, h, T, D]`` (a view)."""
    bt, h, d = y.shape
    return y.view(batch, bt // batch, h, d).transpose(1, 2)


def cumulative(cu: tuple, batch: int, device) -> torch.Tensor:
    """``cu`` repeated for ``batch`` elements (offsets of ``cu[-1]`` each) as int32 ``[batch * S + 1]``."""
    segs = torch.tensor(cu, dtype=torch.int64)
    parts = [segs[:1]] + [segs[1:] + b * cu[-1] for b in range(batch)]
    return torch.cat(parts).to(device=device, dtype=torch.int32)


def _window_kwargs(call: BandCall) -> dict:
    """The window keywords, only where the call has a window beyond ``is_causal`` (documents alone pass none,
    so they run on PyTorch builds whose flash ops predate the window arguments too)."""
    if call.window in ((-1, -1), (-1, 0)):
        return {}
    left, right = call.window
    return dict(window_size_left=left, window_size_right=right)


def flash_forward_args(call: BandCall, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                       batch: int) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of ``aten._flash_attention_forward`` for packed ``q [B*T, H, D]``, ``k, v``."""
    d = q.device
    args = (q, k, v, cumulative(call.cu_q, batch, d), cumulative(call.cu_k, batch, d), call.max_q, call.max_k,
            0.0, call.causal, False)
    return args, dict(scale=scale, **_window_kwargs(call))


def flash_backward_args(call: BandCall, dout, q, k, v, out, lse, scale: float, batch: int) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of ``aten._flash_attention_backward``: packed ``dout, q, out [B*T, H, D]``,
    ``k, v``, ``lse [H, B*T]`` float32 (the rows' global LSE). With no dropout the RNG state is not read;
    empty ``uint64`` tensors of the forward's shapes stand for it."""
    d = q.device
    rng = torch.empty(2, dtype=torch.uint64, device=d)
    unused = torch.empty((), dtype=torch.uint64, device=d)
    args = (dout, q, k, v, out, lse, cumulative(call.cu_q, batch, d), cumulative(call.cu_k, batch, d),
            call.max_q, call.max_k, 0.0, call.causal, rng, unused)
    return args, dict(scale=scale, **_window_kwargs(call))


def efficient_mask_type(call: BandCall) -> Optional[int]:
    """``custom_mask_type`` of the memory-efficient kernel for ``call`` (0: none, 2: causal from the bottom
    right), ``None`` when it takes no such window."""
    return {(-1, -1): 0, (-1, 0): 2}.get(call.window)


def efficient_forward_args(call: BandCall, q, k, v, scale: float, batch: int) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of ``aten._efficient_attention_forward``: ``q [1, B*T, H, D]``, ``k, v`` at the
    query heads."""
    d = q.device
    args = (q, k, v, None, cumulative(call.cu_q, batch, d), cumulative(call.cu_k, batch, d), call.max_q,
            call.max_k, 0.0, efficient_mask_type(call), True)
    return args, dict(scale=scale)


def efficient_backward_args(call: BandCall, dout, q, k, v, out, lse, scale: float, batch: int) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of ``aten._efficient_attention_backward`` (``lse`` in the kernel's padded
    per-segment layout, :func:`efficient_lse`)."""
    d = q.device
    seed = torch.empty((), dtype=torch.int64, device=d)
    args = (dout, q, k, v, None, out, cumulative(call.cu_q, batch, d), cumulative(call.cu_k, batch, d),
            call.max_q, call.max_k, lse, 0.0, seed, seed, efficient_mask_type(call), False)
    return args, dict(scale=scale)


def efficient_lse(rows: torch.Tensor, call: BandCall, batch: int) -> torch.Tensor:
    """Packed-row LSE ``[H, B*T]`` -> the memory-efficient kernel's ``[B*S, H, ceil(max_q/32)*32]``."""
    h = rows.shape[0]
    cu = cumulative(call.cu_q, batch, "cpu").tolist()
    width = math.ceil(call.max_q / 32) * 32
    out = rows.new_zeros(len(cu) - 1, h, width)
    for s in range(len(cu) - 1):
        out[s, :, :cu[s + 1] - cu[s]] = rows[:, cu[s]:cu[s + 1]]
    return out


def efficient_rows(lse: torch.Tensor, call: BandCall, batch: int) -> torch.Tensor:
    """The inverse of :func:`efficient_lse`: ``[B*S, H, W]`` -> ``[H, B*T]``."""
    cu = cumulative(call.cu_q, batch, "cpu").tolist()
    return torch.cat([lse[s, :, :cu[s + 1] - cu[s]] for s in range(len(cu) - 1)], dim=1)


def _segment_scores(q, k, scale, q0, q1, k0, k1, left, right):
    """Masked scores ``[H, m, sk]`` of one segment (flash's rule) in the accumulator dtype."""
    acc = accum_dtype(q.dtype)
    g = q.shape[1] // k.shape[1]
    qs = q[q0:q1].to(acc).transpose(0, 1)                                   # [H, m, D]
    ks = k[k0:k1].to(acc).repeat_interleave(g, dim=1).transpose(0, 1)        # [H, sk, D]
    s = torch.matmul(qs, ks.transpose(-1, -2)) * scale
    m, sk = q1 - q0, k1 - k0
    d = torch.arange(m, device=q.device)[:, None] + sk - m
    j = torch.arange(sk, device=q.device)[None, :]
    vis = torch.ones(m, sk, dtype=torch.bool, device=q.device)
    if left >= 0:
        vis &= j >= d - left
    if right >= 0:
        vis &= j <= d + right
    return s.masked_fill(~vis, -math.inf)


def reference_forward(call: BandCall, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``aten._flash_attention_forward`` computes for ``call`` on packed tensors: ``out [B*T, H, Dv]``
    (q's dtype), ``lse [H, B*T]`` float32 (``+inf`` where a row sees nothing, as flash writes it)."""
    acc = accum_dtype(q.dtype)
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), math.inf, dtype=acc, device=q.device)
    g = q.shape[1] // k.shape[1]
    tq, tk = call.cu_q[-1], call.cu_k[-1]
    for b in range(batch):
        for q0, q1, k0, k1, left, right in segment_ranges(call):
            q0, q1, k0, k1 = q0 + b * tq, q1 + b * tq, k0 + b * tk, k1 + b * tk
            s = _segment_scores(q, k, scale, q0, q1, k0, k1, left, right)
            l_s = torch.logsumexp(s, -1)                                     # [H, m]
            seen = l_s > -math.inf
            p = torch.exp(s - l_s.masked_fill(~seen, 0).unsqueeze(-1))
            vs = v[k0:k1].to(acc).repeat_interleave(g, dim=1).transpose(0, 1)
            out[q0:q1] = torch.matmul(p, vs).masked_fill(~seen.unsqueeze(-1), 0).transpose(0, 1).to(q.dtype)
            lse[:, q0:q1] = l_s.masked_fill(~seen, math.inf)
    return out, lse.float() if acc == torch.float32 else lse


def reference_backward(call: BandCall, dout, q, k, v, out, lse, scale: float, batch: int):
    """What ``aten._flash_attention_backward`` computes: ``dq, dk, dv`` (the inputs' dtypes and shapes)
    from the rows' global ``lse [H, B*T]`` and ``out`` (``P = exp(S - lse)``, ``D = rowsum(dout * out)``)."""
    acc = accum_dtype(q.dtype)
    g = q.shape[1] // k.shape[1]
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc, device=q.device)
    tq, tk = call.cu_q[-1], call.cu_k[-1]
    for b in range(batch):
        for q0, q1, k0, k1, left, right in segment_ranges(call):
            q0, q1, k0, k1 = q0 + b * tq, q1 + b * tq, k0 + b * tk, k1 + b * tk
            s = _segment_scores(q, k, scale, q0, q1, k0, k1, left, right)
            p = torch.exp(s - lse[:, q0:q1].to(acc).unsqueeze(-1))                # [H, m, sk]
            do = dout[q0:q1].to(acc).transpose(0, 1)                               # [H, m, Dv]
            delta = (do * out[q0:q1].to(acc).transpose(0, 1)).sum(-1, keepdim=True)
            vs = v[k0:k1].to(acc).repeat_interleave(g, dim=1).transpose(0, 1)
            ks = k[k0:k1].to(acc).repeat_interleave(g, dim=1).transpose(0, 1)
            ds = p * (torch.matmul(do, vs.transpose(-1, -2)) - delta)
            dq[q0:q1] = (torch.matmul(ds, ks) * scale).transpose(0, 1)
            hk = k.shape[1]
            dk[k0:k1] += (torch.matmul(ds.transpose(-1, -2), q[q0:q1].to(acc).transpose(0, 1)) * scale
                          ).view(hk, g, k1 - k0, -1).sum(1).transpose(0, 1)
            dv[k0:k1] += torch.matmul(p.transpose(-1, -2), do).view(hk, g, k1 - k0, -1).sum(1).transpose(0, 1)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def schema_problem(op_name: str, args: tuple, kwargs: dict) -> Optional[str]:
    """Why ``torch.ops.aten.<op_name>(*args, **kwargs)`` does not match the op's schema (too many
    positional arguments, a keyword it lacks or gives positionally, a required argument missing, a
    tensor where none is taken or the reverse), or ``None``. The schemas exist in every build, CPU included."""
    schema = getattr(torch.ops.aten, op_name).default._schema
    positional = [a for a in schema.arguments if not a.kwarg_only]
    if len(args) > len(positional):
        return f"{op_name}: {len(args)} positional arguments, the schema takes {len(positional)}"
    names = {a.name: a for a in schema.arguments}
    for name in kwargs:
        if name not in names or not names[name].kwarg_only:
            return f"{op_name}: no keyword-only argument {name!r}"
    given = {a.name: x for a, x in zip(positional, args)} | dict(kwargs)
    for a in schema.arguments:
        if a.name not in given:
            if not a.has_default_value():
                return f"{op_name}: argument {a.name!r} missing"
            continue
        x, kind = given[a.name], str(a.type)
        optional = kind.startswith("Optional[")
        base = kind[len("Optional["):-1] if optional else kind
        if x is None:
            if not optional:
                return f"{op_name}: {a.name!r} ({kind}) is not optional"
            continue
        ok = {"Tensor": lambda: isinstance(x, torch.Tensor), "bool": lambda: isinstance(x, bool),
              "int": lambda: isinstance(x, int) and not isinstance(x, bool),
              "float": lambda: isinstance(x, (int, float)) and not isinstance(x, bool)}.get(base, lambda: True)
        if not ok():
            return f"{op_name}: {a.name!r} takes {kind}, got {type(x).__name__} {x!r}"[:200]
    return None

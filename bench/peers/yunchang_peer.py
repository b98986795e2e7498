"""yunchang (long-context-attention, ``pip install --no-deps yunchang``): its Ulysses and its ring.

* ``ulysses``: ``yunchang.UlyssesAttention`` (its all-to-alls) with SDPA as the local attention
  (its own ``attn_fn`` replaced: the built-in choices are flash-attn kernels or a torch path that
  returns a zero LSE).
* ``ring``: ``yunchang.ring.ring_flash_attn_func``, the ring-flash-attn loop. It calls flash-attn's
  CUDA kernels through ``select_flash_attn_impl``; on CPU this adapter stands in for exactly those two
  calls (forward ``(out, lse)`` and the backward that fills ``block_dq/dk/dv`` buffers) with
  ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward, and leaves the loop,
  the merge and the communication as yunchang wrote them (including what it does with dtypes).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from bench.peers import Contender, PeerUnavailable
from bench.peers.deepspeed_ulysses import ulysses_formula
from burstattn.layouts.named import local_positions

VARIANTS = ("ulysses", "ring")
_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _sdpa(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, *args, **kwargs):
    # (B, S, h, D) -> (B, h, S, D) -> SDPA -> (B, S, h, D)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=causal, scale=softmax_scale)
    return out.transpose(1, 2)


def _cpu_fwd(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, *args, **kwargs):
    """flash-attn's ``_flash_attn_forward`` contract: ``(B, S, H, D)`` -> out ``(B, S, H, D)``, lse ``(B, H, S)``."""
    out, lse = _FWD(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, bool(causal), scale=softmax_scale)
    return out.transpose(1, 2), lse


def _cpu_bwd(dout, q, k, v, out, lse, dq_buf, dk_buf, dv_buf, dropout_p=0.0, softmax_scale=None,
             causal=False, *args, **kwargs):
    """flash-attn's ``_flash_attn_backward`` contract: writes dq, dk, dv ``(B, S, H, D)`` into the buffers."""
    t = lambda x: x.transpose(1, 2)  # noqa: E731 - (B, S, H, D) <-> (B, H, S, D)
    dq, dk, dv = _BWD(t(dout).contiguous(), t(q), t(k), t(v), t(out).contiguous(), lse.contiguous(), 0.0,
                      bool(causal), scale=softmax_scale)
    dq_buf.copy_(t(dq)), dk_buf.copy_(t(dk)), dv_buf.copy_(t(dv))


@contextlib.contextmanager
def _cpu_kernels(ring_mod):
    old = ring_mod.select_flash_attn_impl

    def select(attn_type, stage="fwd-bwd", attn_processor=None):
        return {"fwd-only": _cpu_fwd, "bwd-only": _cpu_bwd}[stage]

    ring_mod.select_flash_attn_impl = select
    try:
        yield
    finally:
        ring_mod.select_flash_attn_impl = old


def make(variant: str, *, causal: bool, group) -> Contender:
    try:
        import yunchang
        from yunchang.kernels import AttnType
    except Exception as e:  # noqa: BLE001 - any import failure is the reason it cannot run
        raise PeerUnavailable(f"yunchang cannot be imported: {type(e).__name__}: {e}") from e
    contiguous = lambda s, r, w: local_positions(s, r, w, "contiguous")  # noqa: E731
    if variant == "ulysses":
        layer = yunchang.UlyssesAttention(group, scatter_idx=2, gather_idx=1, attn_type=AttnType.TORCH_FLASH)
        layer.attn_fn = _sdpa
        return Contender("yunchang ulysses", lambda q, k, v: layer(q, k, v, causal=causal), contiguous, "a2a",
                         ulysses_formula)
    if variant == "ring":
        from yunchang.ring import ring_flash_attn as ring_mod

        class _Wrapped(torch.autograd.Function):
            """Keeps the kernel stand-ins installed during yunchang's own forward and backward."""

            @staticmethod
            def forward(ctx, q, k, v):
                with torch.enable_grad(), _cpu_kernels(ring_mod):
                    qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
                    out = ring_mod.ring_flash_attn_func(qq, kk, vv, causal=causal, group=group)
                ctx.inner = (qq, kk, vv, out)  # an inner graph, kept as is
                return out.detach()

            @staticmethod
            def backward(ctx, dout):
                qq, kk, vv, out = ctx.inner
                with _cpu_kernels(ring_mod):
                    return torch.autograd.grad(out, (qq, kk, vv), dout)

        return Contender("yunchang ring (flash-attn calls -> CPU op)", _Wrapped.apply, contiguous, "ring",
                         ring_formula)
    raise ValueError(f"yunchang variant must be one of {VARIANTS}, got {variant!r}")


def ring_formula(*, batch, local_seq, world_size, q_heads, kv_heads, head_dim, dtype, **_) -> dict:
    """From the source: forward K and V to the next rank P-1 times; backward K, V P-1 times plus dK,
    dV P times in float32 (they are accumulated and sent as float32)."""
    kv = 2 * batch * local_seq * kv_heads * head_dim
    fwd = (world_size - 1) * kv * torch.empty((), dtype=dtype).element_size()
    return {"forward": fwd, "backward": fwd + world_size * kv * 4}

"""PyTorch's own context-parallel ring (``torch.distributed.tensor.experimental._context_parallel``).

Its public ``context_parallel()`` intercepts only the CUDA SDPA kernels, so on CPU we call the
templated ring it is built on, ``_templated_ring_attention`` / ``_templated_ring_attention_backward``
(a process group, ``seq_dim=2`` on ``[B, H, S, D]`` local tensors, an attention op), with the CPU
flash op ``aten._scaled_dot_product_flash_attention_for_cpu`` and its ``_backward`` as the op.
Its two module options are set around each call and restored: ``_cp_options.rotate_method``
(``allgather``: one all-gather of K/V, then slices; ``alltoall``: a K/V ring through
``permute_tensor``) and ``_cp_options.enable_load_balance`` (its head-tail layout: rank r holds
chunks r and 2P-1-r, burstattn's ``zigzag``; only for causal). The dK/dV ring of its backward
always uses all-to-all.
"""
from __future__ import annotations

import contextlib

import torch

from bench.peers import Contender, PeerUnavailable
from burstattn.layouts.named import local_positions

VARIANTS = ("allgather", "alltoall", "allgather-lb", "alltoall-lb")


@contextlib.contextmanager
def _options(att, rotate: str, balance: bool):
    opts = att._cp_options
    old = (opts.rotate_method, opts.enable_load_balance)
    opts.rotate_method = att._RotateMethod.ALL_GATHER if rotate == "allgather" else att._RotateMethod.ALL_TO_ALL
    opts.enable_load_balance = balance
    try:
        yield
    finally:
        opts.rotate_method, opts.enable_load_balance = old


def _fwd_op(q, k, v, *, is_causal, **_):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, bool(is_causal))


def _bwd_op(*, grad_out, query, key, value, out, logsumexp, is_causal, **_):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out.contiguous(), query, key, value, out, logsumexp, 0.0, bool(is_causal))


def make(variant: str, *, causal: bool, group) -> Contender:
    try:
        from torch.distributed.tensor.experimental._context_parallel import _attention as att
    except ImportError as e:
        raise PeerUnavailable(f"torch {torch.__version__} has no context-parallel module: {e}") from e
    if variant not in VARIANTS:
        raise ValueError(f"torch_cp variant must be one of {VARIANTS}, got {variant!r}")
    rotate, balance = variant.split("-")[0], variant.endswith("-lb")
    if balance and not causal:
        raise PeerUnavailable("PyTorch CP's head-tail load balancing is causal-only "
                              "(_templated_ring_attention raises 'Load balancing requires is_causal=True')")

    class _Ring(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            with _options(att, rotate, balance):
                out, lse = att._templated_ring_attention(group, 2, _fwd_op, q, k, v, is_causal=causal)[:2]
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx, dout):
            q, k, v, out, lse = ctx.saved_tensors
            with _options(att, rotate, balance):
                dq, dk, dv = att._templated_ring_attention_backward(
                    group, 2, _bwd_op, grad_out=dout, grad_out_name="grad_out", query=q, key=k, value=v,
                    out=out, logsumexp=lse, is_causal=causal)[:3]
            return dq, dk, dv

    def fn(q, k, v):
        # (B, n, H, D) -> (B, H, n, D) contiguous, as the CPU flash op and the ring's seq_dim=2 expect
        qh, kh, vh = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        return _Ring.apply(qh, kh, vh).transpose(1, 2)

    layout = "zigzag" if balance else "contiguous"
    return Contender(f"torch-cp {variant}", fn, lambda s, r, w: local_positions(s, r, w, layout),
                     "gather" if rotate == "allgather" else "ring", formula)


def formula(*, batch, local_seq, world_size, q_heads, kv_heads, head_dim, dtype, **_) -> dict:
    """Bytes per rank from the source: forward K/V once to each of P-1 ranks (one all-gather, or P-1
    ring hops); backward the same for K/V plus P hops of the packed dK/dV in float32 (``convert_to_f32``;
    its dK/dV rotation always uses all-to-all, the last hop brings them home)."""
    kv = 2 * batch * local_seq * kv_heads * head_dim
    fwd = (world_size - 1) * kv * torch.empty((), dtype=dtype).element_size()
    return {"forward": fwd, "backward": fwd + world_size * kv * 4}

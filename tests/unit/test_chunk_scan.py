"""The block scan and the window convolution: gradients equal the plain forms' (float64), and the
tensors kept for the backward shrink to the block-boundary states (the conv: its input table)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from burstattn.recurrent.chunk_scan import block_scan
from burstattn.recurrent.chunked import chunk_delta_rule, chunk_linear_attention
from burstattn.recurrent.passing import _delta_local, _linear_local
from burstattn.recurrent.window import window_conv

D = torch.float64


def _inputs(L, H=2, dk=4, dv=3, channel=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(2, L, H, dk, generator=gen, dtype=D) for _ in range(2))
    v = torch.randn(2, L, H, dv, generator=gen, dtype=D)
    g = -torch.rand(2, L, H, *((dk,) if channel else ()), generator=gen, dtype=D) * 0.3
    beta = torch.rand(2, L, H, generator=gen, dtype=D)
    return [t.requires_grad_() for t in (q, k, v, g, beta)]


def _grads(out, inputs):
    gen = torch.Generator().manual_seed(1)
    loss = sum((o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum() for o in out)
    return torch.autograd.grad(loss, inputs)


@pytest.mark.parametrize("L,block", [(37, 8), (64, 16), (50, 50), (9, 4)])
@pytest.mark.parametrize("channel", [False, True])
def test_block_scan_delta_rule_equals_plain_form(L, block, channel):
    q, k, v, g, beta = _inputs(L, channel=channel)
    S0 = torch.randn(2, 2, 4, 3, dtype=D, requires_grad=True)
    o_ref, S_ref = chunk_delta_rule(q, k, v, g, beta, chunk_size=4, initial_state=S0, use_qk_l2norm=True)

    def fn(carry, q, k, v, g, beta):
        o, S = chunk_delta_rule(q, k, v, g, beta, chunk_size=4, initial_state=carry[0], use_qk_l2norm=True)
        return (o,), (S,)

    (o,), (S,) = block_scan(fn, (S0,), (q, k, v, g, beta), block=block)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(S, S_ref, rtol=0, atol=1e-12)
    for a, b in zip(_grads((o, S), (q, k, v, g, beta, S0)), _grads((o_ref, S_ref), (q, k, v, g, beta, S0))):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11)


def test_block_scan_linear_local_equals_whole_segment():
    """The linear form's local summaries (o0, corr, A, B) by blocks equal one pass over the segment."""
    q, k, v, g, _ = _inputs(70)
    got = _linear_local(4, 0.5)(q, k, v, g)  # blocks of 16 tokens
    o, S = chunk_linear_attention(q, k, v, g, chunk_size=4, scale=0.5)
    G = g.cumsum(1)
    want = (o, q * 0.5 * G.exp().unsqueeze(-1), G[:, -1].exp(), S)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    for a, b in zip(_grads(got, (q, k, v, g)), _grads(want, (q, k, v, g))):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11)


def test_block_scan_unused_outputs_and_frozen_inputs():
    q, k, v, g, beta = _inputs(20)
    k.requires_grad_(False)

    def fn(carry, q, k, v, g, beta):
        o, S = chunk_delta_rule(q, k, v, g, beta, chunk_size=4, initial_state=carry[0])
        return (o, o * 2), (S,)

    (o, _), (S,) = block_scan(fn, (torch.zeros(2, 2, 4, 3, dtype=D),), (q, k, v, g, beta), block=8)
    dq, dv = torch.autograd.grad(o.sum(), (q, v))
    o_ref, _ = chunk_delta_rule(q, k, v, g, beta, chunk_size=4)
    rq, rv = torch.autograd.grad(o_ref.sum(), (q, v))
    torch.testing.assert_close(dq, rq, rtol=0, atol=1e-11)
    torch.testing.assert_close(dv, rv, rtol=0, atol=1e-11)


def _saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd keeps for the backward of ``fn()`` (its inputs excluded)."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def test_delta_local_keeps_only_inputs_and_block_states():
    """The local form keeps its inputs and one ``[dk, dv + dk]`` state per block of 4 chunks, where
    the whole-graph chunked form keeps per-chunk ``[C, C]`` products (several times more)."""
    L, H, dk, dv, C = 512, 2, 16, 16, 16
    q, k, v, g, beta = _inputs(L, H, dk, dv)
    inputs = sum(t.numel() * t.element_size() for t in (q, k, v, g, beta))
    kept = _saved_bytes(lambda: _delta_local(C, None, True)(q, k, v, g, beta))
    states = (L // (4 * C)) * 2 * H * dk * (dv + dk) * 8
    assert kept <= inputs + states + 4096, (kept, inputs, states)

    def plain():
        v_aug = torch.cat([v, v.new_zeros(2, L, H, dk)], -1)
        chunk_delta_rule(q, k, v_aug, g, beta, chunk_size=C, use_qk_l2norm=True)
    assert _saved_bytes(plain) > 4 * kept


@pytest.mark.parametrize("silu,bias", [(True, True), (False, False), (True, False)])
def test_window_conv_equals_autograd_and_keeps_its_table(silu, bias):
    gen = torch.Generator().manual_seed(3)
    n, K, C = 1100, 4, 6  # more than one backward block of tokens
    table = torch.randn(2, n + 3, C, generator=gen, dtype=D, requires_grad=True)
    index = torch.randint(0, n + 3, (n, K), generator=gen)
    w = torch.randn(C, K, generator=gen, dtype=D, requires_grad=True)
    b = torch.randn(C, generator=gen, dtype=D, requires_grad=True) if bias else None
    y = window_conv(table, index, w, b, silu)
    ref = torch.einsum("bnkc,ck->bnc", table[:, index], w) + (0 if b is None else b)
    ref = F.silu(ref) if silu else ref
    torch.testing.assert_close(y, ref, rtol=0, atol=1e-12)
    leaves = [t for t in (table, w, b) if t is not None]
    for a, r in zip(_grads((y,), leaves), _grads((ref,), leaves)):
        torch.testing.assert_close(a, r, rtol=0, atol=1e-10)
    kept = _saved_bytes(lambda: window_conv(table, index, w, b, silu))
    assert kept <= table.numel() * 8 + index.numel() * 8 + w.numel() * 8 + C * 8

"""The float64 oracle against torch's SDPA (math path) in float64, values and gradients."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from burstattn.testing.oracle import exact_attention, exact_rows
from tests.helpers import rel_err


def sdpa64(q, k, v, causal, scale):
    """SDPA in [B, N, H, D], GQA by repeating kv heads."""
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=causal, scale=scale)
    return out.transpose(1, 2)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (4, 1)])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_reference_matches_sdpa_float64(causal, hq, hkv, scale):
    gen = torch.Generator().manual_seed(hq + hkv)
    q = torch.randn(2, 37, hq, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 37, hkv, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 37, hkv, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(2, 37, hq, 16, generator=gen, dtype=torch.float64)
    out, lse = exact_attention(q, k, v, causal=causal, softmax_scale=scale)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    expected = sdpa64(q, k, v, causal, scale)
    expected_grads = torch.autograd.grad(expected, (q, k, v), dout)
    assert out.dtype == torch.float64 and out.shape == (2, 37, hq, 16) and lse.shape == (2, hq, 37)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    for g, e in zip(grads, expected_grads):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-10)
    s = (scale or 16 ** -0.5) * torch.einsum("bihd,bjhd->bhij", q, k.repeat_interleave(hq // hkv, dim=2))
    if causal:
        s = s.masked_fill(torch.ones(37, 37, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(s, -1), rtol=1e-12, atol=1e-12)


def test_reference_upcasts_low_precision_inputs():
    q, k, v = (torch.randn(1, 8, 2, 8).to(torch.bfloat16) for _ in range(3))
    out, lse = exact_attention(q, k, v, causal=True)
    assert out.dtype == lse.dtype == torch.float64
    torch.testing.assert_close(out, sdpa64(q.double(), k.double(), v.double(), True, None))


@pytest.mark.parametrize("causal", [False, True])
def test_rows_match_full(causal):
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 29, h, 8, generator=gen, dtype=torch.float64) for h in (6, 3, 3))
    out, lse = exact_attention(q, k, v, causal=causal)
    rows = torch.tensor([0, 28, 5, 5, 13])
    out_r, lse_r = exact_rows(q[:, rows], k, v, rows, causal=causal)
    torch.testing.assert_close(out_r, out[:, rows], rtol=0, atol=1e-14)
    torch.testing.assert_close(lse_r, lse[:, :, rows], rtol=0, atol=1e-14)


def test_rows_gradients_match_full():
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 12, 2, 4, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    rows = torch.arange(12)
    full = torch.autograd.grad(exact_attention(q, k, v, causal=True)[0].sum(), (q, k, v))
    part = torch.autograd.grad(exact_rows(q, k, v, rows, causal=True)[0].sum(), (q, k, v))
    for a, b in zip(full, part):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("shapes,word", [
    (((2, 8, 4), (2, 8, 4, 8), (2, 8, 4, 8)), "q"),
    (((2, 8, 4, 8), (1, 8, 4, 8), (1, 8, 4, 8)), "batch"),
    (((2, 8, 6, 8), (2, 8, 4, 8), (2, 8, 4, 8)), "heads"),
    (((2, 8, 4, 8), (2, 8, 4, 8), (2, 8, 2, 8)), "agree in batch, seq and heads"),
    (((2, 8, 4, 8), (2, 9, 4, 8), (2, 8, 4, 8)), "agree in batch, seq and heads"),
])
def test_reference_rejects_bad_shapes(shapes, word):
    with pytest.raises(ValueError, match=word):
        exact_attention(*(torch.randn(s) for s in shapes))


def test_unequal_lengths_are_bottom_right_aligned():
    """Nq < Nk causal: query i is the last query of a longer sequence, so it equals the rows of the
    full self-attention at positions Nk - Nq + i; Nq > Nk: the first Nq - Nk rows see nothing."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 10, 2, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    full, full_lse = exact_attention(q, k, v, causal=True)
    tail, tail_lse = exact_attention(q[:, 6:], k, v, causal=True)
    torch.testing.assert_close(tail, full[:, 6:])
    torch.testing.assert_close(tail_lse, full_lse[:, :, 6:])
    out, lse = exact_attention(q, k[:, :7], v[:, :7], causal=True)
    assert torch.isinf(lse[:, :, :3]).all() and (out[:, :3] == 0).all()
    torch.testing.assert_close(out[:, 3:], exact_attention(q[:, 3:], k[:, :7], v[:, :7], causal=True)[0])


def test_rows_reject_bad_positions():
    q, k = torch.randn(1, 3, 2, 4), torch.randn(1, 5, 2, 4)
    with pytest.raises(ValueError, match="row_positions"):
        exact_rows(q, k, k, torch.tensor([0, 1, 5]))
    with pytest.raises(ValueError, match="row_positions"):
        exact_rows(q, k, k, torch.tensor([0, 1]))


def test_rel_err_flags_nan():
    assert rel_err(torch.tensor([float("nan")]), torch.tensor([1.0])) == float("inf")
    assert rel_err(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0])) == 0.0

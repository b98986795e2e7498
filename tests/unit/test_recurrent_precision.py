"""Precision of the recurrences' single-process pieces: the chunk's decays as segment sums (float32 against
float64, and the float32 gradient of the decay against transformers' own float32 Mamba2 scan), and 16-bit
inputs of the public ops against float64 with flash-attn's rule (their products formed in float32)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from burstattn.recurrent import (chunk_linear_attention, recurrent_reference, sp_causal_conv1d, sp_gated_delta_rule,
                                 sp_kda, sp_lightning_attention, sp_linear_attention, sp_ssd)
from burstattn.recurrent.decay import chunk_decays, segsum
from tests.helpers import EXACT, RULE

EPS32 = torch.finfo(torch.float32).eps


def _decays(C: int = 64, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return -torch.rand(3, C, generator=gen, dtype=torch.float64) * 2  # [3, C]: |G| reaches ~64


def test_segsum_is_the_definition():
    g = _decays(9)
    seg = segsum(g)
    for i in range(9):
        for j in range(9):
            want = g[:, j + 1:i + 1].sum(-1) if j <= i else torch.full((3,), float("-inf"), dtype=g.dtype)
            assert torch.equal(seg[:, i, j], want) or (seg[:, i, j] - want).abs().max() < 1e-12, (i, j)
    G, pair, to_end = chunk_decays(g.unsqueeze(-1))  # scalar decay: [3, C, 1]
    assert torch.allclose(G[..., 0], g.cumsum(-1)) and torch.allclose(pair, seg.exp())
    assert torch.allclose(to_end[..., 0], seg[:, -1])
    gc = torch.stack([g, 2 * g], -1)  # per channel [3, C, 2]
    G2, pair2, to_end2 = chunk_decays(gc)
    assert pair2.shape == (3, 9, 9, 2) and torch.allclose(pair2[..., 1], segsum(2 * g).exp())
    assert torch.allclose(to_end2[..., 1], segsum(2 * g)[:, -1])


def test_segsum_float32_within_one_rounding_per_term():
    """Each entry sums its own (same-signed) terms: error <= (terms + 1) * eps * |entry| in float32. The
    difference of two 64-token prefix sums misses that bound by orders of magnitude near the diagonal,
    where the entry is small and the prefix sums are large (the cause of the A_log gradient's error)."""
    g = _decays()
    C = g.shape[-1]
    exact = segsum(g)
    lower = torch.ones(C, C, dtype=torch.bool).tril()
    terms = (torch.arange(C).view(-1, 1) - torch.arange(C).view(1, -1)).clamp_min(0).double()
    bound = (terms + 1) * EPS32 * exact.abs() + 1e-30
    err = (segsum(g.float()).double() - exact).abs()
    assert bool((err <= bound)[:, lower].all()), float((err / bound)[:, lower].max())
    G = g.float().cumsum(-1)
    diff = (G.unsqueeze(-1) - G.unsqueeze(-2)).double()
    assert float((diff - exact).abs()[:, lower].div(bound[:, lower]).max()) > 10


def _ssd_inputs(T: int = 256, H: int = 4, P: int = 8, N: int = 8, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, T, H, P, generator=gen, dtype=torch.float64)
    dt = F.softplus(torch.randn(1, T, H, generator=gen, dtype=torch.float64)).clamp(1e-3, 2.0)
    A = -torch.exp(torch.rand(H, generator=gen, dtype=torch.float64))
    B, C = (torch.randn(1, T, 1, N, generator=gen, dtype=torch.float64) for _ in range(2))
    return x, dt, A, B, C


def _a_grad(fn, dtype, x, dt, A, B, C) -> torch.Tensor:
    A = A.to(dtype).detach().requires_grad_()
    y = fn(x.to(dtype), dt.to(dtype), A, B.to(dtype), C.to(dtype))
    gen = torch.Generator().manual_seed(5)
    (y.double() * torch.randn(y.shape, generator=gen, dtype=torch.float64)).sum().backward()
    return A.grad.double()


def test_ssd_decay_gradient_within_transformers_float32_error():
    """The gradient of ``A`` (through ``dt * A``, the chunk's decays) of the 64-token chunked form in float32,
    against float64: within 3x transformers' own float32 Mamba2 scan (its ``segment_sum``)."""
    bamba = pytest.importorskip("transformers.models.bamba.modeling_bamba", reason="needs transformers")

    def ours(x, dt, A, B, C):
        return sp_ssd(x, dt, A, B, C, chunk_size=64)[0]

    def theirs(x, dt, A, B, C):
        return bamba.mamba2_chunk_scan(x, dt, A, B, C, chunk_size=64)
    inputs = _ssd_inputs()
    ref = _a_grad(ours, torch.float64, *inputs)
    err = {name: float((_a_grad(fn, torch.float32, *inputs) - ref).abs().max() / ref.abs().max())
           for name, fn in (("ours", ours), ("transformers", theirs))}
    assert 0 < err["transformers"] < 1e-4 and err["ours"] <= 3 * err["transformers"], err


def test_chunked_decay_gradient_float32_against_float64():
    """chunk_linear_attention's float32 gradient of the log decay stays at float32 rounding (1e-5 relative)
    however large the chunk's total decay (|G| ~ 60 over a 64-token chunk)."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 128, 2, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    g = -torch.rand(1, 128, 2, generator=gen, dtype=torch.float64) * 2
    grads = []
    for dtype in (torch.float64, torch.float32):
        gg = g.to(dtype).detach().requires_grad_()
        o, S = chunk_linear_attention(q.to(dtype), k.to(dtype), v.to(dtype), gg, chunk_size=64)
        (o.double().sum() + S.double().sum()).backward()
        grads.append(gg.grad.double())
    assert float((grads[1] - grads[0]).norm() / grads[0].norm()) <= EXACT["float32"]


# --- 16-bit inputs: flash-attn's rule against float64 from the same 16-bit inputs

def _bf16_cases():
    gen = torch.Generator().manual_seed(2)

    def r(*shape, lo=None):
        x = torch.randn(*shape, generator=gen, dtype=torch.float64)
        return x if lo is None else -torch.rand(*shape, generator=gen, dtype=torch.float64) * lo
    T, H, dk, dv = 96, 2, 8, 8
    x, dt, A, B, C = _ssd_inputs(T, H, dv, dk, seed=3)
    qn, kn = (F.normalize(r(1, T, H, dk), dim=-1) for _ in range(2))
    beta = torch.rand(1, T, H, generator=gen, dtype=torch.float64)
    rep = dict(q=qn, k=kn, v=r(1, T, H, dv))

    def plain_ssd(x, dt, A, B, C, D):  # the recurrence as written, every op in the inputs' dtype
        y, S = recurrent_reference(C, B * dt.unsqueeze(-1), x, dt * A)
        return y + x * D.view(1, 1, -1, 1), S

    def plain_lightning(q, k, v, s):
        return recurrent_reference(q, k, v, (-s).view(1, 1, -1).expand(1, T, -1))
    D = r(H)
    return {
        "ssd": (sp_ssd, plain_ssd, (x, dt, A, B, C, D), {}),
        "lightning": (sp_lightning_attention, plain_lightning, (*rep.values(), torch.rand(H, generator=gen,
                                                                                          dtype=torch.float64)), {}),
        "linear": (sp_linear_attention, recurrent_reference, (*rep.values(), r(1, T, H, lo=0.5)), {}),
        "gdn": (sp_gated_delta_rule, recurrent_reference, (*rep.values(), r(1, T, H, lo=0.5), beta), {}),
        "kda": (sp_kda, recurrent_reference, (*rep.values(), r(1, T, H, dk, lo=0.5), beta), {}),
    }


def _run(fn, args, dtype, **kw):
    """(output, state, gradients of every input) of ``fn`` on ``args`` cast to ``dtype``."""
    xs = [a.to(dtype).detach().requires_grad_() for a in args]
    out, S = fn(*xs, **kw)
    gen = torch.Generator().manual_seed(9)
    (out.double() * torch.randn(out.shape, generator=gen, dtype=torch.float64)).sum().add(S.double().sum()).backward()
    return out.detach().double(), S.detach().double(), [x.grad.double() for x in xs]


@pytest.mark.parametrize("kind", ["ssd", "lightning", "linear", "gdn", "kda"])
def test_bf16_inputs_within_flash_attn_rule(kind):
    """bf16 inputs: output and every gradient within flash-attn's factor of the error the plain recurrence
    in bf16 makes, against float64 computed from the same bf16 inputs; the final state (float32, formed from
    float32 products) within float32's band, and the output within 2x the bf16 rounding of the truth."""
    fn, plain, args, kw = _bf16_cases()[kind]
    args = tuple(a.bfloat16().double() for a in args)  # the truth's inputs: representable in bf16
    kw = dict(kw, output_final_state=True)
    out, S, grads = _run(fn, args, torch.bfloat16, **kw)
    ref_out, ref_S, ref_grads = _run(fn, args, torch.float64, **kw)
    p_out, p_S, p_grads = _run(plain, args, torch.bfloat16)
    assert out.dtype == torch.float64 and S.shape == ref_S.shape
    err, p_err = (out - ref_out).abs().max(), (p_out - ref_out).abs().max()
    assert err <= RULE["out"] * p_err, (kind, float(err), float(p_err))
    assert err <= 2 * (ref_out.bfloat16().double() - ref_out).abs().max() + 1e-6 * ref_out.abs().max(), kind
    assert float((S - ref_S).norm() / ref_S.norm()) <= EXACT["float32"], kind
    for i, (g, rg, pg) in enumerate(zip(grads, ref_grads, p_grads)):
        assert (g - rg).abs().max() <= RULE["dq"] * (pg - rg).abs().max(), (kind, i)


def test_bf16_conv_computes_in_float32():
    gen = torch.Generator().manual_seed(4)
    x, w, b = (torch.randn(*s, generator=gen, dtype=torch.float64).bfloat16() for s in ((2, 40, 6), (6, 4), (6,)))
    y = sp_causal_conv1d(x, w, b, activation="silu")
    ref = sp_causal_conv1d(x.double(), w.double(), b.double(), activation="silu")
    plain = F.silu(F.conv1d(F.pad(x.transpose(1, 2), (3, 0)), w.unsqueeze(1), b, groups=6)).transpose(1, 2)
    err = (y.double() - ref).abs().max()
    assert y.dtype == torch.bfloat16 and err <= RULE["out"] * (plain.double() - ref).abs().max()
    assert err <= 2 * (ref.bfloat16().double() - ref).abs().max()

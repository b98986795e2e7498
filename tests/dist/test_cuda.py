"""CUDA kernels (sdpa, flash_attn) at world size 1 against the float64 reference, in bfloat16.

Skipped without CUDA; flash_attn cases are skipped when the package is not importable.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

import burstattn
from burstattn.kernels import get_kernel
from burstattn.testing.oracle import exact_attention
from tests.helpers import Case, full_inputs, reference_results, rel_err

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
BACKENDS = ["sdpa", pytest.param("flash_attn", marks=pytest.mark.skipif(
    importlib.util.find_spec("flash_attn") is None, reason="flash-attn not installed"))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", ["mha", "gqa"])
def test_cuda_func_world_one(backend, causal, heads):
    case = Case(world=1, local_seq=256, batch=2, heads=heads, head_dim=64, dtype="bfloat16", causal=causal,
                layout="contiguous", backend=backend)
    q, k, v, dout = (x.cuda() for x in full_inputs(case))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out, lse = burstattn.burst_attn_func(q, k, v, causal=causal, layout="contiguous", backend=backend,
                                         return_lse=True)
    out.backward(dout)
    ref = reference_results(case)
    got = dict(out=out, lse=lse, dq=q.grad, dk=k.grad, dv=v.grad)
    errors = {name: rel_err(got[name].detach().cpu(), ref[name]) for name in got}
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert all(err <= 2e-2 for err in errors.values()), errors


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_kernel_forward(backend, causal):
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 128, 64, generator=gen).to("cuda", torch.bfloat16)  # [B, H, S, D]
    k, v = (torch.randn(1, 2, 128, 64, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    out, lse = get_kernel(backend).forward(q, k, v, 0.125, causal)
    ref_out, ref_lse = exact_attention(*(x.transpose(1, 2).cpu() for x in (q, k, v)), causal=causal,
                                           softmax_scale=0.125)
    assert rel_err(out.transpose(1, 2).cpu(), ref_out) <= 2e-2
    assert rel_err(lse.cpu(), ref_lse) <= 2e-2


def test_cuda_world_one_16bit_runs_the_kernels_own_backward(monkeypatch):
    """A 16-bit call alone on a GPU is one kernel forward and one kernel backward in the inputs' dtype
    (not the engine's float32 tiles, which run SDPA's float32 kernel: 6-10x slower on an H200)."""
    from burstattn.kernels.sdpa import SdpaKernel

    seen = []
    real = SdpaKernel.backward

    def spy(self, dout, q, *rest, **kw):
        seen.append(q.dtype)
        return real(self, dout, q, *rest, **kw)

    monkeypatch.setattr(SdpaKernel, "backward", spy)
    q = torch.randn(1, 512, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, 512, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in "kv")
    burstattn.burst_attn_func(q, k, v, causal=True, backend="sdpa").sum().backward()
    assert seen == [torch.bfloat16]


FLA = pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="flash-linear-attention not installed")


def _recurrence_inputs(op: str, T: int = 192, seed: int = 0) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k = (torch.nn.functional.normalize(r(2, T, 2, 32), dim=-1) for _ in range(2))
    v = r(2, T, 4, 32)
    g = -torch.rand(2, T, 4, generator=gen, dtype=torch.float64) * 0.5
    beta = torch.rand(2, T, 4, generator=gen, dtype=torch.float64)
    if op == "kda":
        g = -torch.rand(2, T, 4, 32, generator=gen, dtype=torch.float64) * 0.5
    return {"gdn": (q, k, v, g, beta), "kda": (q, k, v, g, beta), "linear": (q, k, v, g),
            "ssd": (v, -g, -torch.rand(4, generator=gen, dtype=torch.float64), q[:, :, :1], k[:, :, :1])}[op]


def _recurrence(op: str):
    from burstattn import recurrent as rec

    return {"gdn": rec.sp_gated_delta_rule, "kda": rec.sp_kda, "linear": rec.sp_linear_attention,
            "ssd": rec.sp_ssd}[op]


def _recurrence_run(op, args, dtype, device, **kw):
    xs = [a.to(device, dtype).detach().requires_grad_() for a in args]
    out, S = _recurrence(op)(*xs, output_final_state=True, **kw)
    gen = torch.Generator().manual_seed(7)
    dout = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(device)
    (out.double() * dout).sum().add(S.double().sum()).backward()
    return [out.detach().double().cpu(), S.detach().double().cpu()] + [x.grad.double().cpu() for x in xs]


@FLA
@pytest.mark.parametrize("op", ["gdn", "kda", "linear", "ssd"])
def test_cuda_recurrence_fla_kernel_against_the_torch_form(op):
    """On CUDA with flash-linear-attention importable, ``kernel="auto"`` runs fla's chunk kernel per segment;
    in bf16 its output, final state and every gradient are within flash-attn's factor (3x) of the larger of
    the torch chunked form's error on the same bf16 inputs and one bf16 rounding of the truth (fla forms its
    products in the inputs' dtype), all against float64 (CPU)."""
    from burstattn.recurrent.kernels import resolve_kernel

    assert resolve_kernel("auto", torch.device("cuda"), torch.float32) == "fla"
    args = tuple(a.bfloat16().double() for a in _recurrence_inputs(op))
    ref = _recurrence_run(op, args, torch.float64, "cpu", kernel="torch")
    torch_form = _recurrence_run(op, args, torch.bfloat16, "cuda", kernel="torch")
    fla = _recurrence_run(op, args, torch.bfloat16, "cuda", kernel="fla")
    for i, (a, b, r) in enumerate(zip(fla, torch_form, ref)):
        err, band = rel_err(a, r), max(rel_err(b, r), rel_err(r.bfloat16(), r))
        assert err <= 3 * band, (op, i, err, band)

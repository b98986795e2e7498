"""The per-segment kernel choice of the recurrences (burstattn.recurrent.kernels): the selector, the refusal
of kernel='fla' where it cannot run, and the flash-linear-attention hook's wiring (identity columns, the
decay's prefix sums) run on CPU with the torch chunked forms standing in for fla's kernels."""
from __future__ import annotations

import pytest
import torch

from burstattn.recurrent import kernels, passing
from burstattn.recurrent import sp_gated_delta_rule, sp_kda, sp_lightning_attention, sp_linear_attention, sp_ssd
from burstattn.recurrent.chunked import chunk_delta_rule, chunk_linear_attention

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


def test_segment_backend_picks_fla_only_on_cuda_with_the_package():
    assert kernels.segment_backend(CUDA, True) == "fla"
    assert kernels.segment_backend(CUDA, True, torch.bfloat16) == "fla"
    assert kernels.segment_backend(CUDA, True, torch.float64) == "torch"  # Triton's dots: no float64
    assert kernels.segment_backend(CUDA, False) == "torch"
    assert kernels.segment_backend(CPU, True) == "torch"
    assert kernels.resolve_kernel("torch", CUDA, torch.float32) == "torch"
    assert kernels.resolve_kernel("auto", CPU, torch.float32) == "torch"


def test_kernel_problems_name_the_fix():
    assert kernels.kernel_problem("auto", CPU, torch.float32) is None
    assert "one of" in kernels.kernel_problem("triton", CPU, torch.float32)
    assert "CUDA tensors" in kernels.kernel_problem("fla", CPU, torch.float32, available=True)
    assert "pip install flash-linear-attention" in kernels.kernel_problem("fla", CUDA, torch.float32, available=False)
    assert "float64" in kernels.kernel_problem("fla", CUDA, torch.float64, available=True)
    assert kernels.kernel_problem("fla", CUDA, torch.bfloat16, available=True) is None


def _inputs(seed=0, T=24):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k = r(2, T, 1, 4), r(2, T, 1, 4)
    v = r(2, T, 2, 3)
    g = -torch.rand(2, T, 2, generator=gen, dtype=torch.float64)
    gc = -torch.rand(2, T, 2, 4, generator=gen, dtype=torch.float64)
    beta = torch.rand(2, T, 2, generator=gen, dtype=torch.float64)
    return q, k, v, g, gc, beta


@pytest.mark.parametrize("op", ["gdn", "kda", "linear", "ssd", "lightning"])
def test_fla_kernel_is_refused_on_cpu(op):
    q, k, v, g, gc, beta = _inputs()
    calls = {"gdn": lambda: sp_gated_delta_rule(q, k, v, g, beta, kernel="fla"),
             "kda": lambda: sp_kda(q, k, v, gc, beta, kernel="fla"),
             "linear": lambda: sp_linear_attention(q, k, v, g, kernel="fla"),
             "ssd": lambda: sp_ssd(v, -g, g[0, 0], q, k, kernel="fla"),
             "lightning": lambda: sp_lightning_attention(q, q, v[:, :, :1], g[0, 0, :1].abs(), kernel="fla")}
    with pytest.raises(ValueError, match="kernel='fla' runs flash-linear-attention's Triton kernels on CUDA"):
        calls[op]()
    with pytest.raises(ValueError, match="kernel must be one of"):
        sp_gated_delta_rule(q, k, v, g, beta, kernel="triton")


def _stand_ins(monkeypatch):
    """fla's kernels replaced by the torch chunked forms (same contract: initial state in, final state out),
    and the "fla" path chosen on CPU."""
    seen = []

    def delta(q, k, v, g, beta, *, scale, initial_state, use_qk_l2norm):
        seen.append("delta")
        return chunk_delta_rule(q, k, v, g, beta, initial_state=initial_state, scale=scale,
                                use_qk_l2norm=use_qk_l2norm)

    def linear(q, k, v, g, *, scale):
        seen.append("linear")
        return chunk_linear_attention(q, k, v, g, scale=scale)
    monkeypatch.setattr(kernels, "fla_delta_rule", delta)
    monkeypatch.setattr(kernels, "fla_linear_attention", linear)
    monkeypatch.setattr(passing, "kernel_problem", lambda *a, **k: None)
    monkeypatch.setattr(passing, "resolve_kernel", lambda *a, **k: "fla")
    return seen


@pytest.mark.parametrize("op", ["gdn", "kda", "linear", "ssd"])
def test_fla_hook_wiring_equals_the_torch_form(monkeypatch, op):
    """The fla path's per-segment function, with the torch forms standing in for the kernels, gives the
    torch path's output, final state and gradients (world 1, an initial state): the hook's own arithmetic
    (identity columns, corr, the decay's prefix sums) is exact."""
    q, k, v, g, gc, beta = _inputs(1)
    S0 = torch.randn(2, 2, 4, 3, dtype=torch.float64)
    fns = {"gdn": lambda *x, **kw: sp_gated_delta_rule(x[0], x[1], x[2], x[3], x[5], use_qk_l2norm=True, **kw),
           "kda": lambda *x, **kw: sp_kda(x[0], x[1], x[2], x[4], x[5], **kw),
           "linear": lambda *x, **kw: sp_linear_attention(x[0], x[1], x[2], x[3], scale=0.5, **kw),
           "ssd": lambda *x, **kw: sp_ssd(x[2], -x[3], x[3][0, 0], x[0], x[1], **kw)}

    def run(kernel):
        xs = [t.clone().requires_grad_() for t in (q, k, v, g, gc, beta, S0)]
        out, S = fns[op](*xs[:6], kernel=kernel, chunk_size=8, output_final_state=True, initial_state=xs[6])
        (out.sum() + (S * S).sum()).backward()
        return [out.detach(), S.detach()] + [x.grad for x in xs if x.grad is not None]
    want = run("torch")
    seen = _stand_ins(monkeypatch)
    got = run("fla")
    assert seen and len(got) == len(want)
    for a, b in zip(got, want):
        assert (a - b).abs().max() <= 1e-12 * b.abs().max().clamp_min(1), op


def test_fake_tensors_take_the_torch_form():
    """The dry run's fake tensors never reach a Triton kernel, whatever the device and package."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        t = torch.empty(2, 3)
        assert kernels.is_fake(t) and kernels.resolve_kernel("auto", CUDA, torch.float32, fake=True) == "torch"
    assert not kernels.is_fake(torch.empty(1))

"""burst_attn_func without torch.distributed (a world of one in this process)."""
from __future__ import annotations

import pytest
import torch

import burstattn
from tests.helpers import Case, full_inputs, reference_results, tolerance_failures


@pytest.mark.parametrize("case", [
    Case(world=1, local_seq=20, heads="gqa", causal=True, backend="cpu_flash", backward="burst"),
    Case(world=1, local_seq=20, heads="mqa", causal=False, backend="reference", backward="kv", dtype="bfloat16"),
    Case(world=1, local_seq=21, heads="mha", causal=True, layout="striped", backend="auto", softmax_scale=0.5),
    Case(world=1, local_seq=8, heads="mha", causal=True, layout="contiguous", dtype="float64"),
], ids=Case.id)
def test_world_of_one_without_process_group(case):
    q, k, v, dout = full_inputs(case)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out, lse = burstattn.burst_attn_func(q, k, v, causal=case.causal, softmax_scale=case.softmax_scale,
                                         layout=case.layout, return_lse=True, backend=case.backend,
                                         backward=case.backward)
    out.backward(dout)
    ref = reference_results(case)
    got = dict(out=out, lse=lse, dq=q.grad, dk=k.grad, dv=v.grad)
    bad = tolerance_failures(case, {name: x.detach() for name, x in got.items()}, ref)
    assert not bad, bad
    assert out.dtype == q.dtype and lse.dtype == (torch.float64 if q.dtype == torch.float64 else torch.float32)


def test_no_grad_inputs_run_forward_only():
    q, k, v = (torch.randn(1, 8, 2, 8) for _ in range(3))
    out = burstattn.burst_attn_func(q, k, v, causal=True)
    assert not out.requires_grad and out.shape == q.shape


@pytest.mark.parametrize("kwargs,exc,word", [
    (dict(layout="diagonal"), ValueError, "layout"),
    (dict(backend="sdpa"), ValueError, "sdpa"),
    (dict(backward="both"), ValueError, "backward"),
    (dict(softmax_scale=float("nan")), ValueError, "softmax_scale"),
    (dict(group=object()), ValueError, "group"),
])
def test_bad_options_without_process_group(kwargs, exc, word):
    q, k, v = (torch.randn(1, 8, 2, 8) for _ in range(3))
    with pytest.raises(exc, match=word):
        burstattn.burst_attn_func(q, k, v, **kwargs)


def test_module_repr_and_forward():
    mod = burstattn.BurstAttention(causal=True, layout="striped")
    q, k, v = (torch.randn(1, 6, 2, 8) for _ in range(3))
    assert torch.equal(mod(q, k, v), burstattn.burst_attn_func(q, k, v, causal=True, layout="striped"))
    assert "striped" in repr(mod)


def test_window_size_is_flash_attn_spelling_of_window():
    """flash-attn's ``window_size=(left, right)`` gives exactly ``window=``'s result (function and
    module); both at once is refused, naming both."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 64, 2, 16, generator=g, dtype=torch.float64) for _ in range(3))
    want = burstattn.burst_attn_func(q, k, v, causal=True, window=(7, 0))
    got = burstattn.burst_attn_func(q, k, v, causal=True, window_size=(7, 0))
    assert torch.equal(got, want)
    assert not torch.equal(burstattn.burst_attn_func(q, k, v, causal=True), want)  # the window matters here
    assert torch.equal(burstattn.BurstAttention(causal=True, window_size=(7, -1))(q, k, v), want)
    with pytest.raises(ValueError, match="window or window_size"):
        burstattn.burst_attn_func(q, k, v, causal=True, window=(7, 0), window_size=(7, 0))

"""A dense call at a world of one is one kernel block: burst and ring call the local kernel directly
(no engine loop, no float32 accumulators), exactly; everything the kernel's own call cannot express
(a mask, a score modifier, sinks, cross lengths, 16-bit float32 partials) still runs the engine."""
from __future__ import annotations

import pytest
import torch

import burstattn
import burstattn.strategies.burst as burst
from tests.helpers import Case, full_inputs, reference_results, tolerance_failures


def _engine_calls(monkeypatch) -> list:
    calls = []
    for name in ("forward_pass", "backward_pass"):
        real = getattr(burst, name)
        monkeypatch.setattr(burst, name, lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
    return calls


@pytest.mark.parametrize("strategy", ["burst", "ring"])
@pytest.mark.parametrize("case", [
    Case(world=1, local_seq=36, heads="gqa", causal=True, backend="cpu_flash", layout="zigzag"),
    Case(world=1, local_seq=16, heads="mha", causal=False, backend="auto", layout="striped", softmax_scale=0.3),
    Case(world=1, local_seq=9, heads="mqa", causal=True, layout="contiguous", dtype="float64"),
], ids=Case.id)
def test_dense_world_of_one_is_one_kernel_call_and_exact(monkeypatch, strategy, case):
    calls = _engine_calls(monkeypatch)
    q, k, v, dout = full_inputs(case)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    kw = dict(causal=case.causal, softmax_scale=case.softmax_scale, layout=case.layout, backend=case.backend)
    if strategy == "burst":
        out, lse = burstattn.burst_attn_func(q, k, v, return_lse=True, **kw)
    else:
        out, lse = burstattn.attention(q, k, v, strategy=strategy, **kw), None
    out.backward(dout)
    got = dict(out=out, dq=q.grad, dk=k.grad, dv=v.grad, **({} if lse is None else {"lse": lse}))
    bad = tolerance_failures(case, {name: x.detach() for name, x in got.items()}, reference_results(case))
    assert not bad, bad
    assert calls == [], calls
    assert out.dtype == q.dtype and q.grad.dtype == q.dtype and (lse is None or lse.shape == (q.shape[0], q.shape[2], q.shape[1]))


@pytest.mark.parametrize("kwargs,dtype", [
    (dict(window_size=(4, 0)), torch.float32),      # a mask
    (dict(softcap=5.0), torch.float32),             # a score modifier
    (dict(sinks=torch.zeros(4)), torch.float32),    # sinks
    ({}, torch.bfloat16),                           # 16-bit: the float32 partials
])
def test_what_the_kernel_call_cannot_express_runs_the_engine(monkeypatch, kwargs, dtype):
    calls = _engine_calls(monkeypatch)
    q, k, v = (torch.randn(1, 12, 4, 8, dtype=dtype, requires_grad=True) for _ in range(3))
    burstattn.burst_attn_func(q, k, v, causal=True, **kwargs).sum().backward()
    assert calls == ["forward_pass", "backward_pass"], calls

"""One call path (issue 28): each call runs the local input check once and resolves the backend once,
for burst_attn_func and for every strategy of ``attention`` (world of one, no process group)."""
from __future__ import annotations

import pytest
import torch

import burstattn
from burstattn import autograd, kernels, validate
from burstattn.strategies import op


@pytest.mark.parametrize("strategy", ["burst_attn_func", "burst", "ring", "ulysses", "allgather", "tp", "usp"])
def test_local_check_once_and_backend_resolved_once(monkeypatch, strategy):
    counts = {"check": 0, "resolve": 0}

    def counting(name, fn):
        def wrapped(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return wrapped

    check = counting("check", validate.local_problem)
    resolve = counting("resolve", kernels.resolve_backend)
    for module in (validate, op):
        monkeypatch.setattr(module, "local_problem", check)
    for module in (kernels, op, autograd):
        monkeypatch.setattr(module, "resolve_backend", resolve)
    q, k, v = (torch.randn(1, 16, 2, 8, requires_grad=True) for _ in range(3))
    if strategy == "burst_attn_func":
        out = burstattn.burst_attn_func(q, k, v, causal=True)
    else:
        out = burstattn.attention(q, k, v, strategy=strategy, causal=True,
                                  **(dict(ulysses_degree=1) if strategy == "usp" else {}))
    out.sum().backward()
    assert counts == {"check": 1, "resolve": 1}, counts

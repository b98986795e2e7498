"""One call path: each call runs the local input check once and resolves the backend once,
for burst_attn_func and for every strategy of ``attention`` (world of one, no process group)."""
from __future__ import annotations

import pytest
import torch

import burstattn
from burstattn import kernels
from burstattn.call import engine_adapter as passes, validate
from burstattn.call import prepare as op


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
    for module in (kernels, op, passes):
        monkeypatch.setattr(module, "resolve_backend", resolve)
    q, k, v = (torch.randn(1, 16, 2, 8, requires_grad=True) for _ in range(3))
    if strategy == "burst_attn_func":
        out = burstattn.burst_attn_func(q, k, v, causal=True)
    else:
        out = burstattn.attention(q, k, v, strategy=strategy, causal=True,
                                  **(dict(ulysses_degree=1) if strategy == "usp" else {}))
    out.sum().backward()
    assert counts == {"check": 1, "resolve": 1}, counts


MASKS = {"window": dict(window=(3, 0)), "documents": dict(cu_seqlens=[0, 5, 16]),
         "mask_mod": dict(mask_mod=lambda qp, kp: (qp - kp) % 3 != 1)}


@pytest.mark.parametrize("kind", sorted(MASKS))
def test_mask_summary_built_once_per_shape_in_the_users_mask(monkeypatch, kind):
    """BurstAttention keeps one AttnMask, and the op finds that object again (by its definition,
    registered when the call crosses the op; a mask_mod's call carries it directly): over 3 calls of one
    shape, forward and backward, the block summary is built once, and it is in the user's mask."""
    from burstattn.comm.host import LruCache
    from burstattn.masks import blocks, setup

    monkeypatch.setattr(setup, "DATA_MASKS", LruCache(32))  # no mask of an earlier test serves this one
    builds = []
    real = blocks.mask_ops

    def counting(*args, **kwargs):
        builds.append(args[2].numel())
        return real(*args, **kwargs)

    monkeypatch.setattr(blocks, "mask_ops", counting)
    module = burstattn.BurstAttention(causal=True, **MASKS[kind])
    q, k, v = (torch.randn(1, 16, 2, 8, requires_grad=True) for _ in range(3))
    for _ in range(3):
        module(q, k, v).sum().backward()
    assert builds == [16], builds  # world of one: one pair (this rank's queries x its keys), one shape
    assert [key for key in module.mask.cache if key[0] == "ops"], "the summary is not in the user's AttnMask"


def test_rare_keywords_one_typed_object_or_one_by_one():
    """flash-attn's shape with the rare options in burstattn.BurstOptions; each rare keyword still works
    on its own (the same result), not both at once, and an unknown keyword names BurstOptions' fields."""
    q, k, v = (torch.randn(1, 16, 2, 8, dtype=torch.float64) for _ in range(3))
    by_object = burstattn.burst_attn_func(q, k, v, causal=True, window_size=(4, 0),
                                          options=burstattn.BurstOptions(backend="reference", cu_seqlens=[0, 6, 16]))
    by_keyword = burstattn.burst_attn_func(q, k, v, causal=True, window_size=(4, 0), backend="reference",
                                           cu_seqlens=[0, 6, 16])
    assert torch.equal(by_object, by_keyword)
    module = burstattn.BurstAttention(causal=True, window=(4, 0), backend="reference", cu_seqlens=[0, 6, 16])
    assert torch.equal(module(q, k, v), by_keyword) and module.options.backend == "reference"
    with pytest.raises(TypeError, match="not both"):
        burstattn.burst_attn_func(q, k, v, options=burstattn.BurstOptions(), backend="reference")
    with pytest.raises(TypeError, match="BurstOptions.*backend"):
        burstattn.burst_attn_func(q, k, v, bakend="reference")

"""The custom op: torch.compile(fullgraph=True) equals eager, the remat checkpoint policy skips the
distributed forward in the recomputation, and second-order gradients are refused."""
from __future__ import annotations

import pytest
import torch

from burstattn import ops
from tests.dist import op_cases


def test_op_handles_and_policy():
    assert ops.SAVED_OPS == (torch.ops.burstattn.attention_fwd.default,)
    from torch.utils.checkpoint import CheckpointPolicy

    policy = ops.remat_policy()
    assert policy(None, torch.ops.burstattn.attention_fwd.default) is CheckpointPolicy.MUST_SAVE
    assert policy(None, torch.ops.aten.mm.default) is CheckpointPolicy.PREFER_RECOMPUTE
    spec = ops.OpSpec("attention(strategy='ring')", True, 0.25, "partition:a;b", "reference", "kv", "ring",
                      ["g1", "g2", 2, 2], [4, None], True, 64)
    back = ops.OpSpec.decode(spec.encode())
    assert back == ops.OpSpec("attention(strategy='ring')", True, 0.25, "partition:a,b", "reference", "kv", "ring",
                              ["g1", "g2", 2, 2], [4, None], True, 64)


@pytest.mark.parametrize("strategy", ["burst_attn_func", "burst", "ring"])
def test_compile_fullgraph_equals_eager(pools, strategy):
    # aot_eager: the whole graph capture (dynamo, fake tensors, AOT autograd) without C++ codegen
    for diffs in pools.get(2).run(op_cases.compiled_vs_eager, strategy, "aot_eager"):
        assert max(diffs.values()) == 0.0, diffs


@pytest.mark.slow
def test_compile_inductor(pools, request):
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("inductor's C++ compile takes ~100 s on 2 cores: run with -m slow")
    for diffs in pools.get(2).run(op_cases.compiled_vs_eager, "burst_attn_func", "inductor"):
        assert max(diffs.values()) < 1e-5, diffs


def test_selective_checkpoint_runs_forward_once(pools):
    runs = {policy: pools.get(2).run(op_cases.checkpoint_forwards, policy) for policy in ("none", "plain", "sac")}
    assert [r["forwards"] for r in runs["none"]] == [1, 1]
    assert [r["forwards"] for r in runs["plain"]] == [2, 2]  # plain checkpointing reruns the distributed forward
    assert [r["forwards"] for r in runs["sac"]] == [1, 1]  # MUST_SAVE on the op: it does not
    for policy in ("plain", "sac"):
        for a, b in zip(runs["none"], runs[policy]):
            for name in ("dq", "dk", "dv"):
                assert torch.equal(a[name], b[name]), (policy, name)


@pytest.mark.parametrize("path", ["op", "mask_mod"])
@pytest.mark.parametrize("world", [1, 2])
def test_double_backward_refused(pools, world, path):
    for text in pools.get(world).run(op_cases.double_backward, path):
        assert text.startswith("RuntimeError: burstattn: second-order gradients"), text

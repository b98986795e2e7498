"""Rank-side functions of tests/dist/test_ops.py (module-level so they pickle by reference)."""
from __future__ import annotations

import torch

import burstattn
from burstattn import ops
from tests.helpers import Case, full_inputs


def _shards(case: Case, layout: str):
    return [burstattn.shard_sequence(x, layout=layout).detach().clone().requires_grad_(i < 3)
            for i, x in enumerate(full_inputs(case))]


def compiled_vs_eager(rank: int, world: int, strategy: str, backend: str) -> dict:
    """``torch.compile(fullgraph=True)`` of a function calling the attention, forward + backward,
    against the same function run eagerly: max abs differences of out, dq, dk, dv."""
    torch._dynamo.reset()
    case = Case(world=world, local_seq=8, heads="gqa", head_dim=16, causal=True)
    layout = "contiguous" if strategy == "ring" else "zigzag"
    opts: dict = {"usp": dict(ulysses_degree=2), "usp-ring": dict(ring_degree=2)}.get(strategy, {})
    strategy = strategy.split("-")[0]

    def fn(q, k, v):
        if strategy == "burst_attn_func":
            out = burstattn.burst_attn_func(q, k, v, causal=True, layout=layout, backend="reference")
        else:
            out = burstattn.attention(q, k, v, strategy=strategy, causal=True, layout=layout, backend="reference",
                                      **opts)
        return (out * 2).sin()

    results = []
    for run in (fn, torch.compile(fn, fullgraph=True, backend=backend)):
        q, k, v, dout = _shards(case, layout)
        out = run(q, k, v)
        out.backward(dout)
        results.append([out.detach(), q.grad, k.grad, v.grad])
    return {name: float((a - b).abs().max()) for name, a, b in zip(("out", "dq", "dk", "dv"), *results)}


def checkpoint_forwards(rank: int, world: int, policy: str) -> dict:
    """Forward passes of the op (counted by the input checks it runs, one per forward) in one
    forward + backward of a checkpointed block, and the gradients (equal in every mode)."""
    from torch.utils.checkpoint import checkpoint

    case = Case(world=world, local_seq=8, heads="mha", head_dim=16, causal=True)
    q, k, v, dout = _shards(case, "zigzag")

    def block(q, k, v):
        return burstattn.burst_attn_func(q.sin(), k, v, causal=True, backend="reference").cos()

    with burstattn.comm_stats() as stats:
        if policy == "none":
            out = block(q, k, v)
        elif policy == "plain":
            out = checkpoint(block, q, k, v, use_reentrant=False)
        else:
            out = checkpoint(block, q, k, v, use_reentrant=False, context_fn=ops.save_attention_context())
        out.backward(dout)
    forwards = stats.as_dict()["forward"]["meta"]["msgs"] if world > 1 else None
    return dict(forwards=forwards, dq=q.grad, dk=k.grad, dv=v.grad)


def double_backward(rank: int, world: int, path: str) -> str:
    """The error of a second-order gradient through the op (``path="op"``) or the eager
    function (``"mask_mod"``), as ``"ExcType: message"``."""
    case = Case(world=world, local_seq=8, heads="mha", head_dim=16, dtype="float64")
    q, k, v, _ = _shards(case, "zigzag")
    extra = dict(mask_mod=lambda qp, kp: kp <= qp + 100) if path == "mask_mod" else {}
    out = burstattn.burst_attn_func(q, k, v, backend="reference", **extra)
    try:  # the op refuses at the second backward; the eager function already at the first one
        (g,) = torch.autograd.grad(out.sum(), q, create_graph=True)
        g.sum().backward()
    except RuntimeError as e:
        return f"RuntimeError: {e}"
    return "no error"

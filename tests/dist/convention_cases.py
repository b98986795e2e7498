"""Rank-side functions of tests/dist/test_conventions.py: flash-attn's conventions (windows with -1,
``deterministic``, ``dropout_p``, ``max_seqlen``), the empty-row LSE convention, refusals on every
rank, and ``torch.compile(fullgraph=True)`` with the new arguments."""
from __future__ import annotations

import torch

import burstattn
from burstattn.layouts.named import local_positions
from tests.dist import feature_cases as fc


def _shards(case: fc.FCase, rank: int, world: int, grad: bool = True):
    t = fc.inputs(case)
    qp = local_positions(case.q_len, rank, world, case.layout)
    kp = local_positions(case.k_len, rank, world, case.keys_layout)
    q = t["q"].index_select(1, qp).requires_grad_(grad)
    k, v = (t[n].index_select(1, kp).requires_grad_(grad) for n in ("k", "v"))
    return q, k, v, t["dout"].index_select(1, qp), t


def windows(rank: int, world: int) -> dict:
    """``window=(-1, -1)`` is no window (bitwise, and the dense ring's bytes); ``(-1, 0)`` is ``(None, 0)``."""
    case = fc.FCase(world, causal=True, layout="contiguous")
    q, k, v, _, _ = _shards(case, rank, world, grad=False)
    res = {}
    for name, kw in (("none", {}), ("minus", dict(window=(-1, -1))), ("left_none", dict(window=(None, 0))),
                     ("left_minus", dict(window=(-1, 0)))):
        with burstattn.comm_stats() as stats:
            out = burstattn.burst_attn_func(q, k, v, causal=True, layout="contiguous", backend="reference", **kw)
        res[name] = (out, stats.sent("forward"))
    return res


def deterministic(rank: int, world: int) -> bool:
    """Two calls with ``deterministic=True`` give bitwise equal outputs and gradients."""
    case = fc.FCase(world, nq=6, nk=10, causal=True, sinks=True, softcap=2.0, heads="4/1")
    runs = []
    for _ in range(2):
        q, k, v, dout, t = _shards(case, rank, world)
        sinks = t["sinks"].clone().requires_grad_()
        out = burstattn.burst_attn_func(q, k, v, causal=True, softcap=2.0, sinks=sinks, deterministic=True)
        out.backward(dout)
        runs.append([out.detach(), q.grad, k.grad, v.grad, sinks.grad])
    return all(torch.equal(a, b) for a, b in zip(*runs))


def empty_rows(rank: int, world: int) -> dict:
    """Nq > Nk, causal: the first Nq - Nk queries see no key: output 0 and LSE -inf; with sinks the
    LSE is the sink's logit (exactly) and the output still 0."""
    case = fc.FCase(world, nq=12, nk=4, causal=True, layout="contiguous")
    q, k, v, _, t = _shards(case, rank, world, grad=False)
    sinks = torch.randn(case.hq, generator=torch.Generator().manual_seed(5))
    out, lse = burstattn.burst_attn_func(q, k, v, causal=True, layout="contiguous", return_lse=True)
    out_s, lse_s = burstattn.burst_attn_func(q, k, v, causal=True, layout="contiguous", return_lse=True, sinks=sinks)
    blind = local_positions(case.q_len, rank, world, "contiguous") < case.q_len - case.k_len  # [n]
    return dict(blind=blind, out=out, lse=lse, out_s=out_s, lse_s=lse_s, sinks=sinks)


def refused(rank: int, world: int, kind: str, only_rank: int = -1) -> tuple[str, str]:
    """One bad call (on every rank, or on ``only_rank``): exception type and message."""
    case = fc.FCase(world, nq=4, nk=8)
    q, k, v, _, _ = _shards(case, rank, world, grad=False)
    same_k, same_v = q.clone(), q.clone()  # one sequence for the strategies that need it
    bad = only_rank < 0 or rank == only_rank
    calls = {
        "dropout": lambda: burstattn.burst_attn_func(q, k, v, dropout_p=0.1 if bad else 0.0),
        "softcap_backend": lambda: burstattn.burst_attn_func(q, k, v, softcap=2.0 if bad else None,
                                                            backend="cpu_flash"),
        "negative_softcap": lambda: burstattn.burst_attn_func(q, k, v, softcap=-1.0 if bad else None),
        "alibi_shape": lambda: burstattn.burst_attn_func(q, k, v, alibi_slopes=torch.ones(3 if bad else 4)),
        "sinks_shape": lambda: burstattn.burst_attn_func(q, k, v, sinks=torch.ones(2, 4) if bad else None),
        "sinks_int": lambda: burstattn.burst_attn_func(q, k, v, sinks=torch.ones(4, dtype=torch.int64)),
        "max_seqlen": lambda: burstattn.burst_attn_func(q, k, v, cu_seqlens_q=[0, 2, 4 * world],
                                                        cu_seqlens_k=[0, 4, 8 * world], max_seqlen_q=2 if bad else None),
        "docs_count": lambda: burstattn.burst_attn_func(q, k, v, cu_seqlens_q=[0, 2, 4 * world],
                                                        cu_seqlens_k=[0, 8 * world]),
        "docs_without_k": lambda: burstattn.burst_attn_func(q, k, v, cu_seqlens=[0, 2, 4 * world]),
        "zigzag_odd_keys": lambda: burstattn.burst_attn_func(q, k[:, :7] if bad else k[:, :6], v[:, :7] if bad
                                                             else v[:, :6]),
        "distflash_cross": lambda: burstattn.burst_attn_func(q, k, v, causal=True, layout="contiguous",
                                                             schedule="distflash"),
        "ulysses_softcap": lambda: burstattn.attention(q, same_k, same_v, strategy="ulysses", softcap=2.0),
        "allgather_cross": lambda: burstattn.attention(q, k, v, strategy="allgather"),
        "tp_v_head_dim": lambda: burstattn.attention(q, same_k, same_v[..., :8], strategy="tp"),
        "ranks_differ": lambda: burstattn.burst_attn_func(q, k, v, softcap=2.0 if rank == 0 else 3.0),
    }
    try:
        calls[kind]()
    except (TypeError, ValueError) as e:
        return type(e).__name__, str(e)
    return "no error", ""


def compiled_vs_eager(rank: int, world: int, strategy: str) -> dict:
    """``torch.compile(fullgraph=True, backend="aot_eager")`` of a call with every new argument
    (cross-attention, softcap, ALiBi, sinks, V's own head size) against the same function eagerly."""
    torch._dynamo.reset()
    case = fc.FCase(world, nq=4, nk=8, dv=8, causal=True, alibi="heads", sinks=True, softcap=2.0,
                    layout="contiguous" if strategy == "ring" else "zigzag")
    t = fc.inputs(case)

    def fn(q, k, v, sinks):
        kw = dict(causal=True, layout=case.layout, backend="reference", softcap=2.0, alibi_slopes=t["alibi"],
                  sinks=sinks)
        if strategy == "burst_attn_func":
            out = burstattn.burst_attn_func(q, k, v, **kw)
        else:
            out = burstattn.attention(q, k, v, strategy=strategy, **kw)
        return (out * 2).sin()

    results = []
    for run in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
        q, k, v, dout, _ = _shards(case, rank, world)
        sinks = t["sinks"].clone().requires_grad_()
        out = run(q, k, v, sinks)
        out.backward(dout)
        results.append([out.detach(), q.grad, k.grad, v.grad, sinks.grad])
    return {name: float((a - b).abs().max()) for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), *results)}

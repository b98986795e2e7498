"""Rank-side functions of tests/dist/test_keywords.py (module-level so they pickle by reference): every keyword of
``burst_attn_func`` with a value other than its default, through each front door."""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

import burstattn

LOCAL, HEADS, DIM = 8, 6, 8  # per rank: 8 tokens, 6 query and key heads (ulysses / tp split them over 2 or 3 ranks)


def _documents(n: int) -> dict:
    return dict(cu_seqlens=[0, 5, n])


# keyword -> the call's keywords that give it a value other than its default (with what it needs beside it),
# from (world, global length N); every keyword of burst_attn_func appears once (the test checks it)
CASES: dict[str, Callable[[int, int], dict]] = {
    "causal": lambda w, n: dict(causal=True),
    "softmax_scale": lambda w, n: dict(softmax_scale=0.3),
    "layout": lambda w, n: dict(layout="contiguous"),
    "group": lambda w, n: dict(group=dist.group.WORLD),
    "window": lambda w, n: dict(window=(3, 0)),
    "window_size": lambda w, n: dict(window_size=(3, 1)),
    "cu_seqlens": lambda w, n: _documents(n),
    "cu_seqlens_q": lambda w, n: dict(cu_seqlens_q=[0, 5, n]),
    "cu_seqlens_k": lambda w, n: dict(**_documents(n), cu_seqlens_k=[0, 7, n]),
    "max_seqlen": lambda w, n: dict(**_documents(n), max_seqlen=n),
    "max_seqlen_q": lambda w, n: dict(**_documents(n), max_seqlen_q=n),
    "max_seqlen_k": lambda w, n: dict(**_documents(n), max_seqlen_k=n),
    "document_ids": lambda w, n: dict(document_ids=[0] * 5 + [1] * (n - 5)),
    "mask_mod": lambda w, n: dict(mask_mod=lambda qp, kp: (qp - kp) % 3 != 1),
    "mask": lambda w, n: dict(mask=burstattn.AttnMask(window=(2, 2))),
    "backend": lambda w, n: dict(backend="reference"),
    "backward": lambda w, n: dict(backward="kv"),
    "schedule": lambda w, n: dict(schedule="distflash", causal=True, layout="contiguous"),
    "topology": lambda w, n: dict(schedule="double", topology=burstattn.two_level_groups(1)),
    "kv_layout": lambda w, n: dict(kv_layout="contiguous"),
    "sinks": lambda w, n: dict(sinks=torch.linspace(-1.0, 1.0, HEADS, dtype=torch.float64).requires_grad_()),
    "grad_partials": lambda w, n: dict(grad_partials="kernel"),
    "device_type": lambda w, n: dict(device_type="cpu"),
    "softcap": lambda w, n: dict(softcap=5.0),
    "alibi_slopes": lambda w, n: dict(alibi_slopes=torch.linspace(0.1, 0.6, HEADS, dtype=torch.float64)),
    "dropout_p": lambda w, n: dict(dropout_p=0.1),  # refused by every door alike
    "deterministic": lambda w, n: dict(deterministic=True),
    "return_lse": lambda w, n: dict(return_lse=True),
    "options": lambda w, n: dict(options=burstattn.BurstOptions(backward="kv", **_documents(n)), window=(4, 0)),
}


def _inputs(rank: int, world: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    full = [torch.randn(1, LOCAL * world, HEADS, DIM, generator=gen, dtype=torch.float64) for _ in range(4)]
    return [x[:, rank * LOCAL:(rank + 1) * LOCAL].clone().requires_grad_(i < 3) for i, x in enumerate(full)]


def _run(door: Callable, kw: dict, rank: int, world: int):
    """``door``'s outputs and gradients (the sinks' included), or the error it raised as ``(type, message)``
    (the message without the door's own name)."""
    q, k, v, dout = _inputs(rank, world)
    sinks = kw.get("sinks")
    if sinks is not None:
        sinks.grad = None
    try:
        res = door(q, k, v, kw)
    except (TypeError, ValueError) as e:
        text = str(e)
        return type(e).__name__, text.split(": ", 1)[1] if text.startswith(("burst_attn_func", "attention(")) else text
    out, lse = res if isinstance(res, tuple) else (res, None)
    out.backward(dout)
    return [out.detach(), lse, q.grad, k.grad, v.grad, None if sinks is None else sinks.grad.clone()]


DOORS = {
    "burst_attn_func": lambda q, k, v, kw: burstattn.burst_attn_func(q, k, v, **kw),
    "attention": lambda q, k, v, kw: burstattn.attention(q, k, v, strategy="burst", **kw),
    "BurstAttention": lambda q, k, v, kw: burstattn.BurstAttention(**kw)(q, k, v),
}


def every_door(rank: int, world: int, keyword: str) -> dict:
    """The results of ``burst_attn_func``, ``attention(strategy="burst")`` and ``BurstAttention`` for the
    keyword's case (the same keywords, fresh inputs each)."""
    kw = CASES[keyword](world, LOCAL * world)
    return {name: _run(door, kw, rank, world) for name, door in DOORS.items()}


def other_strategies(rank: int, world: int, keyword: str) -> dict:
    """For each strategy but burst: ``("refused", message)`` when it refuses the keyword's case, else
    ``("ran", max |out - burst_attn_func's out|)`` (``("error", message)``: it raised something else)."""
    from burstattn.strategies import STRATEGIES

    kw = CASES[keyword](world, LOCAL * world)
    want = _run(DOORS["burst_attn_func"], kw, rank, world)
    result = {}
    for name in STRATEGIES:
        if name == "burst":
            continue
        extra = dict(ulysses_degree=1) if name == "usp" else {}
        got = _run(lambda q, k, v, kw: burstattn.attention(q, k, v, strategy=name, **kw, **extra), kw, rank, world)
        if isinstance(got, tuple):
            result[name] = ("refused" if "does not support" in got[1] else "error", got[1])
        elif isinstance(want, tuple):
            result[name] = ("error", f"burst_attn_func raised {want} but strategy {name} ran")
        else:
            result[name] = ("ran", float((got[0] - want[0]).abs().max()))
    return result

"""The call options of the engine strategies (burst, ring): cross-attention and unequal lengths,
separate documents, softcap, ALiBi, sinks, a V head size of its own; flash-attn's conventions
(windows with -1, ``deterministic``, ``dropout_p``, ``max_seqlen``, empty rows). Rank-side functions and
the float64 oracle they are checked against.

The oracle's visibility (:func:`visibility`) is written independently of the library's masks: one
document at a time, in the document's local coordinates, with flash-attn's bottom-right alignment.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch
import torch.distributed as dist

import burstattn
from burstattn.layouts.named import local_positions
from burstattn.testing.oracle import exact_attention


# ---- the options, their oracle and their bytes (test_features.py) --------------------------------
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


@dataclass(frozen=True)
class FCase:
    """One call: ``nq`` / ``nk`` query / key rows per rank, heads ``"hq/hkv"``, q/k head size ``d`` and
    V's ``dv``; ``docs``: ``None``, or ``(cu_q, cu_k)`` fractions of the two lengths (document ends as
    fractions, the last one 1.0); ``alibi``: ``""``, ``"heads"`` (``[Hq]``) or ``"batch"`` (``[B, Hq]``)."""

    world: int
    nq: int = 8
    nk: int = 8
    batch: int = 1
    heads: str = "4/2"
    d: int = 16
    dv: int = 16
    dtype: str = "float32"
    causal: bool = False
    layout: str = "zigzag"
    kv_layout: Optional[str] = None
    backward: str = "auto"
    backend: str = "reference"
    strategy: str = "burst"
    schedule: str = "ring"
    softcap: Optional[float] = None
    alibi: str = ""
    sinks: bool = False
    window: Optional[tuple] = None
    docs: Optional[tuple] = None
    seed: int = 0

    @property
    def hq(self) -> int:
        return int(self.heads.split("/")[0])

    @property
    def hkv(self) -> int:
        return int(self.heads.split("/")[1])

    @property
    def q_len(self) -> int:
        return self.nq * self.world

    @property
    def k_len(self) -> int:
        return self.nk * self.world

    @property
    def keys_layout(self) -> str:
        return self.kv_layout or self.layout

    def cu(self) -> Optional[tuple[list, list]]:
        """The documents as ``(cu_seqlens_q, cu_seqlens_k)`` in tokens (``None``: none)."""
        if self.docs is None:
            return None
        ends_q, ends_k = self.docs

        def cut(ends, n):
            return [0] + [max(1, round(f * n)) for f in ends[:-1]] + [n]
        return cut(ends_q, self.q_len), cut(ends_k, self.k_len)

    def id(self) -> str:
        bits = [f"w{self.world}", f"{self.nq}x{self.nk}", self.heads, f"d{self.d}" + (f"v{self.dv}" if self.dv != self.d
                else ""), self.dtype, "causal" if self.causal else "full", self.layout,
                self.kv_layout or "", self.backward, self.backend, self.strategy, self.schedule,
                f"cap{self.softcap}" if self.softcap else "", f"alibi-{self.alibi}" if self.alibi else "",
                "sinks" if self.sinks else "", f"win{self.window}" if self.window else "",
                "docs" if self.docs else ""]
        return "-".join(b for b in bits if b)

    def with_(self, **kw) -> "FCase":
        return replace(self, **kw)


def inputs(case: FCase) -> dict:
    """Full q ``[B, Nq, Hq, d]``, k ``[B, Nk, Hkv, d]``, v ``[B, Nk, Hkv, dv]``, grad_out, and the
    modifier tensors, the same on every rank (from the seed)."""
    gen = torch.Generator().manual_seed(case.seed)
    dt = DTYPES[case.dtype]
    b = case.batch
    t = dict(q=torch.randn(b, case.q_len, case.hq, case.d, generator=gen),
             k=torch.randn(b, case.k_len, case.hkv, case.d, generator=gen),
             v=torch.randn(b, case.k_len, case.hkv, case.dv, generator=gen),
             dout=torch.randn(b, case.q_len, case.hq, case.dv, generator=gen))
    t = {name: x.to(dt) for name, x in t.items()}
    if case.alibi:
        shape = (case.hq,) if case.alibi == "heads" else (b, case.hq)
        t["alibi"] = torch.rand(shape, generator=gen) * 0.5 + 0.05
    if case.sinks:
        t["sinks"] = torch.randn(case.hq, generator=gen) + 1.0
    return t


def visibility(case: FCase) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle's bool ``[Nq, Nk]`` visibility and the queries' positions in the keys' coordinates
    ``[Nq]``, one document at a time (local coordinates, offset ``L_k - L_q``: bottom-right)."""
    nq, nk = case.q_len, case.k_len
    cu_q, cu_k = case.cu() or ([0, nq], [0, nk])
    vis = torch.zeros(nq, nk, dtype=torch.bool)
    aligned = torch.empty(nq, dtype=torch.int64)
    left, right = case.window or (None, None)
    left = None if left == -1 else left
    right = None if right == -1 else right
    for d in range(len(cu_q) - 1):
        lq, lk = cu_q[d + 1] - cu_q[d], cu_k[d + 1] - cu_k[d]
        a = torch.arange(lq)[:, None] + (lk - lq)  # query row in the document's key coordinates
        bk = torch.arange(lk)[None, :]
        ok = torch.ones(lq, lk, dtype=torch.bool)
        if case.causal:
            ok &= bk <= a
        if left is not None:
            ok &= bk >= a - left
        if right is not None:
            ok &= bk <= a + right
        vis[cu_q[d]:cu_q[d + 1], cu_k[d]:cu_k[d + 1]] = ok
        aligned[cu_q[d]:cu_q[d + 1]] = cu_k[d] + torch.arange(lq) + (lk - lq)
    return vis, aligned


def reference(case: FCase) -> dict:
    """The float64 oracle: out, lse, dq, dk, dv (and dsinks) over the full sequences."""
    t = inputs(case)
    vis, aligned = visibility(case)
    q, k, v = (t[n].double().requires_grad_() for n in ("q", "k", "v"))
    sinks = t["sinks"].double().requires_grad_() if case.sinks else None
    out, lse = exact_attention(q, k, v, softmax_scale=None, mask=vis, softcap=case.softcap,
                                   alibi_slopes=t.get("alibi"), sinks=sinks, q_positions=aligned)
    out.backward(t["dout"].double())
    res = dict(out=out.detach(), lse=lse.detach(), dq=q.grad, dk=k.grad, dv=v.grad)
    if case.sinks:
        res["dsinks"] = sinks.grad
    return res


def options(case: FCase, t: dict) -> dict:
    """The keyword arguments of the call (beyond q, k, v) for ``case``."""
    kw = dict(causal=case.causal, layout=case.layout, backend=case.backend)
    if case.kv_layout:
        kw["kv_layout"] = case.kv_layout
    if case.strategy == "burst":
        kw.update(backward=case.backward, schedule=case.schedule)
    if case.schedule == "double":
        kw["topology"] = burstattn.two_level_groups(2)
    for name, value in (("softcap", case.softcap), ("window", case.window), ("alibi_slopes", t.get("alibi"))):
        if value is not None:
            kw[name] = value
    if case.docs:
        cu_q, cu_k = case.cu()
        kw.update(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(b - a for a, b in zip(cu_q, cu_q[1:])))
    return kw


def formula(case: FCase, rank: int, dtype) -> dict:
    """The bytes ``rank`` must send: the sparse plan's (masks), the double ring's or the ring's."""
    from burstattn.engine import bytes as formulas
    from burstattn.masks import AttnMask, choose_mask_backward, mask_bytes, mask_plan

    shape = dict(batch=case.batch, local_seq=case.nq, q_heads=case.hq, kv_heads=case.hkv, head_dim=case.d,
                 dtype=dtype, kv_local_seq=case.nk, v_head_dim=case.dv)
    if case.world == 1:
        return {}
    sparse = case.window is not None or case.docs is not None
    mode = "kv" if case.strategy == "ring" else case.backward
    if sparse:
        cu = case.cu()
        mask = AttnMask(window=case.window, cu_seqlens=cu and cu[0], cu_seqlens_k=cu and cu[1])
        mode = choose_mask_backward(**shape) if mode == "auto" else mode
        plan = mask_plan(mask, case.causal, case.q_len, case.world, case.layout, rank, case.k_len, case.keys_layout)
        return mask_bytes(plan, backward=mode, **shape)["ops"]
    mode = formulas.choose_backward(world_size=case.world, **shape) if mode == "auto" else mode
    if case.schedule == "double":
        return formulas.double_bytes(world_size=case.world, ranks_per_node=2, backward=mode, **shape)["ops"]
    return formulas.ring_bytes(world_size=case.world, backward=mode, **shape)["ops"]


def run_one(rank: int, world: int, case: FCase) -> dict:
    """Forward (with LSE) + backward of this rank's shard; the bytes sent and their formula."""
    t = inputs(case)
    q_pos = local_positions(case.q_len, rank, world, case.layout)
    k_pos = local_positions(case.k_len, rank, world, case.keys_layout)
    q = t["q"].index_select(1, q_pos).requires_grad_()
    k, v = (t[n].index_select(1, k_pos).requires_grad_() for n in ("k", "v"))
    dout = t["dout"].index_select(1, q_pos)
    sinks = t["sinks"].clone().requires_grad_() if case.sinks else None
    kw = options(case, t)
    with burstattn.comm_stats() as stats:
        if case.strategy == "burst":
            out, lse = burstattn.burst_attn_func(q, k, v, sinks=sinks, return_lse=True, **kw)
        else:
            out, lse = burstattn.attention(q, k, v, strategy=case.strategy, sinks=sinks, **kw), None
        out.backward(dout)
    sent = {key: b for key, b in stats.sent_by_op().items() if b}
    return dict(out=out.detach(), lse=lse, dq=q.grad, dk=k.grad, dv=v.grad,
                dsinks=None if sinks is None else sinks.grad, q_pos=q_pos, k_pos=k_pos, sent=sent,
                formula={key: b for key, b in formula(case, rank, q.dtype).items() if b})


def run_many(rank: int, world: int, cases: list) -> list:
    """:func:`run_one` for every case (one pool call for many small cases)."""
    return [run_one(rank, world, c) for c in cases]


def assemble(results: list, name: str, pos: str, length: int, dim: int) -> torch.Tensor:
    """Every rank's shard of ``name`` back at its global positions (``pos``: ``"q_pos"`` / ``"k_pos"``)."""
    shape = list(results[0][name].shape)
    shape[dim] = length
    full = torch.empty(shape, dtype=results[0][name].dtype)
    for r in results:
        full.index_copy_(dim, r[pos], r[name])
    return full


def errors(case: FCase, results: list) -> dict:
    """Relative Frobenius errors against the oracle, and whether LSE is ``-inf`` exactly where the
    oracle's is (rows that see nothing)."""
    ref = reference(case)
    got = dict(out=assemble(results, "out", "q_pos", case.q_len, 1), dq=assemble(results, "dq", "q_pos", case.q_len, 1),
               dk=assemble(results, "dk", "k_pos", case.k_len, 1), dv=assemble(results, "dv", "k_pos", case.k_len, 1))
    if results[0]["lse"] is not None:
        got["lse"] = assemble(results, "lse", "q_pos", case.q_len, 2)
    if case.sinks:
        got["dsinks"] = sum(r["dsinks"].double() for r in results)
    # a gradient that is exactly 0 in exact arithmetic is measured against the scale of dv instead
    floor = float(ref["dv"].norm())
    err = {}
    for name, x in got.items():
        r = ref[name]
        if name == "lse":
            blind = torch.isinf(r)
            err["lse_blind_match"] = bool(torch.equal(torch.isinf(x) & (x < 0), blind))
            x, r = x[~blind], r[~blind]
        if not torch.isfinite(x).all():
            err[name] = float("inf")
            continue
        scale = float(r.norm()) if name in ("lse", "dsinks", "out") else max(float(r.norm()), floor)
        err[name] = float((x.double() - r).norm() / max(scale, 1e-300))
    return err


# ---- flash-attn's conventions (test_conventions.py) ----------------------------------------------
# Windows with -1, ``deterministic``, ``dropout_p``, ``max_seqlen``, the empty-row LSE convention, refusals
# on every rank, and ``torch.compile(fullgraph=True)`` with the new arguments.
def _shards(case: FCase, rank: int, world: int, grad: bool = True):
    t = inputs(case)
    qp = local_positions(case.q_len, rank, world, case.layout)
    kp = local_positions(case.k_len, rank, world, case.keys_layout)
    q = t["q"].index_select(1, qp).requires_grad_(grad)
    k, v = (t[n].index_select(1, kp).requires_grad_(grad) for n in ("k", "v"))
    return q, k, v, t["dout"].index_select(1, qp), t


def windows(rank: int, world: int) -> dict:
    """``window=(-1, -1)`` is no window (bitwise, and the dense ring's bytes); ``(-1, 0)`` is ``(None, 0)``."""
    case = FCase(world, causal=True, layout="contiguous")
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
    case = FCase(world, nq=6, nk=10, causal=True, sinks=True, softcap=2.0, heads="4/1")
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
    case = FCase(world, nq=12, nk=4, causal=True, layout="contiguous")
    q, k, v, _, t = _shards(case, rank, world, grad=False)
    sinks = torch.randn(case.hq, generator=torch.Generator().manual_seed(5))
    out, lse = burstattn.burst_attn_func(q, k, v, causal=True, layout="contiguous", return_lse=True)
    out_s, lse_s = burstattn.burst_attn_func(q, k, v, causal=True, layout="contiguous", return_lse=True, sinks=sinks)
    blind = local_positions(case.q_len, rank, world, "contiguous") < case.q_len - case.k_len  # [n]
    return dict(blind=blind, out=out, lse=lse, out_s=out_s, lse_s=lse_s, sinks=sinks)


def refused(rank: int, world: int, kind: str, only_rank: int = -1) -> tuple[str, str]:
    """One bad call (on every rank, or on ``only_rank``): exception type and message."""
    case = FCase(world, nq=4, nk=8)
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
    case = FCase(world, nq=4, nk=8, dv=8, causal=True, alibi="heads", sinks=True, softcap=2.0,
                    layout="contiguous" if strategy == "ring" else "zigzag")
    t = inputs(case)

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


# ---- every keyword through each front door (test_keywords.py) ------------------------------------
KW_LOCAL, KW_HEADS, KW_DIM = 8, 6, 8  # per rank: 8 tokens, 6 query and key heads (ulysses / tp split them over 2 or 3 ranks)


def _keyword_documents(n: int) -> dict:
    return dict(cu_seqlens=[0, 5, n])


# keyword -> the call's keywords that give it a value other than its default (with what it needs beside it),
# from (world, global length N); every keyword of burst_attn_func appears once (the test checks it)
KEYWORD_CASES: dict[str, Callable[[int, int], dict]] = {
    "causal": lambda w, n: dict(causal=True),
    "softmax_scale": lambda w, n: dict(softmax_scale=0.3),
    "layout": lambda w, n: dict(layout="contiguous"),
    "group": lambda w, n: dict(group=dist.group.WORLD),
    "window": lambda w, n: dict(window=(3, 0)),
    "window_size": lambda w, n: dict(window_size=(3, 1)),
    "cu_seqlens": lambda w, n: _keyword_documents(n),
    "cu_seqlens_q": lambda w, n: dict(cu_seqlens_q=[0, 5, n]),
    "cu_seqlens_k": lambda w, n: dict(**_keyword_documents(n), cu_seqlens_k=[0, 7, n]),
    "max_seqlen": lambda w, n: dict(**_keyword_documents(n), max_seqlen=n),
    "max_seqlen_q": lambda w, n: dict(**_keyword_documents(n), max_seqlen_q=n),
    "max_seqlen_k": lambda w, n: dict(**_keyword_documents(n), max_seqlen_k=n),
    "document_ids": lambda w, n: dict(document_ids=[0] * 5 + [1] * (n - 5)),
    "mask_mod": lambda w, n: dict(mask_mod=lambda qp, kp: (qp - kp) % 3 != 1),
    "mask": lambda w, n: dict(mask=burstattn.AttnMask(window=(2, 2))),
    "backend": lambda w, n: dict(backend="reference"),
    "backward": lambda w, n: dict(backward="kv"),
    "schedule": lambda w, n: dict(schedule="distflash", causal=True, layout="contiguous"),
    "topology": lambda w, n: dict(schedule="double", topology=burstattn.two_level_groups(1)),
    "kv_layout": lambda w, n: dict(kv_layout="contiguous"),
    "sinks": lambda w, n: dict(sinks=torch.linspace(-1.0, 1.0, KW_HEADS, dtype=torch.float64).requires_grad_()),
    "grad_partials": lambda w, n: dict(grad_partials="kernel"),
    "device_type": lambda w, n: dict(device_type="cpu"),
    "softcap": lambda w, n: dict(softcap=5.0),
    "alibi_slopes": lambda w, n: dict(alibi_slopes=torch.linspace(0.1, 0.6, KW_HEADS, dtype=torch.float64)),
    "dropout_p": lambda w, n: dict(dropout_p=0.1),  # refused by every door alike
    "deterministic": lambda w, n: dict(deterministic=True),
    "return_lse": lambda w, n: dict(return_lse=True),
    "options": lambda w, n: dict(options=burstattn.BurstOptions(backward="kv", **_keyword_documents(n)), window=(4, 0)),
}


def _keyword_inputs(rank: int, world: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    full = [torch.randn(1, KW_LOCAL * world, KW_HEADS, KW_DIM, generator=gen, dtype=torch.float64) for _ in range(4)]
    return [x[:, rank * KW_LOCAL:(rank + 1) * KW_LOCAL].clone().requires_grad_(i < 3) for i, x in enumerate(full)]


def _keyword_run(door: Callable, kw: dict, rank: int, world: int):
    """``door``'s outputs and gradients (the sinks' included), or the error it raised as ``(type, message)``
    (the message without the door's own name)."""
    q, k, v, dout = _keyword_inputs(rank, world)
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


KEYWORD_DOORS = {
    "burst_attn_func": lambda q, k, v, kw: burstattn.burst_attn_func(q, k, v, **kw),
    "attention": lambda q, k, v, kw: burstattn.attention(q, k, v, strategy="burst", **kw),
    "BurstAttention": lambda q, k, v, kw: burstattn.BurstAttention(**kw)(q, k, v),
}


def every_door(rank: int, world: int, keyword: str) -> dict:
    """The results of ``burst_attn_func``, ``attention(strategy="burst")`` and ``BurstAttention`` for the
    keyword's case (the same keywords, fresh inputs each)."""
    kw = KEYWORD_CASES[keyword](world, KW_LOCAL * world)
    return {name: _keyword_run(door, kw, rank, world) for name, door in KEYWORD_DOORS.items()}


def other_strategies(rank: int, world: int, keyword: str) -> dict:
    """For each strategy but burst: ``("refused", message)`` when it refuses the keyword's case, else
    ``("ran", max |out - burst_attn_func's out|)`` (``("error", message)``: it raised something else)."""
    from burstattn.strategies import STRATEGIES

    kw = KEYWORD_CASES[keyword](world, KW_LOCAL * world)
    want = _keyword_run(KEYWORD_DOORS["burst_attn_func"], kw, rank, world)
    result = {}
    for name in STRATEGIES:
        if name == "burst":
            continue
        extra = dict(ulysses_degree=1) if name == "usp" else {}
        got = _keyword_run(lambda q, k, v, kw: burstattn.attention(q, k, v, strategy=name, **kw, **extra), kw, rank, world)
        if isinstance(got, tuple):
            result[name] = ("refused" if "does not support" in got[1] else "error", got[1])
        elif isinstance(want, tuple):
            result[name] = ("error", f"burst_attn_func raised {want} but strategy {name} ran")
        else:
            result[name] = ("ran", float((got[0] - want[0]).abs().max()))
    return result

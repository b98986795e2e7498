"""Rank side of tests/dist/test_recurrent.py: every recurrence x layout x packing x dtype against one process.

Each rank builds the same full inputs, shards them, runs the sequence-parallel recurrence (with
its final state), backpropagates ``sum(o * dout) + sum(final * dS)`` and gathers the gradients;
the float64 token-by-token recurrence on the full sequence is the oracle. A replicated parameter's
gradient (Mamba2's ``A``/``D``, lightning's ``slope``, the convolution's weight and bias) is the sum
over ranks of their partial gradients.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

import burstattn
from burstattn import recurrent as rec
from burstattn.recurrent.segments import doc_starts
from tests.dist.layout_cases import random_partition
from tests.helpers import rel_err


@dataclass(frozen=True)
class RecCase:
    kind: str          # gdn | kda | linear | ssd | lightning | conv
    layout: str        # contiguous | zigzag | striped | partition
    dtype: str         # float64 | float32
    world: int
    packed: bool = False
    local_seq: int = 6
    seed: int = 0
    scheme: str = "auto"  # how summaries travel: auto | allgather | scan
    initial: bool = False  # continue from an initial state (with its gradient)


SHARDED = {"gdn": "qkvgb", "kda": "qkvgb", "linear": "qkvg", "ssd": "xdBC", "lightning": "qkv", "conv": "x"}
REPLICATED = {"ssd": "AD", "lightning": "s", "conv": "wc"}


def inputs(case: RecCase) -> dict:
    """Full float64 inputs by name (``[B, N, ...]`` for the sharded ones); with ``initial`` also
    ``S0 [B, H, dk, dv]``, the state before position 0 (replicated)."""
    full = _inputs(case)
    if case.initial and case.kind != "conv":
        gen = torch.Generator().manual_seed(case.seed + 7)
        full["S0"] = torch.randn(2, 2, 4, 3, generator=gen, dtype=torch.float64) * 0.5
    return full


def _inputs(case: RecCase) -> dict:
    gen = torch.Generator().manual_seed(case.seed)
    B, N, Hk, H, dk, dv = 2, case.local_seq * case.world, 1, 2, 4, 3

    def r(*shape, lo=None):
        x = torch.randn(*shape, generator=gen, dtype=torch.float64)
        return x if lo is None else -torch.rand(*shape, generator=gen, dtype=torch.float64) * lo
    if case.kind in ("gdn", "kda"):
        g = r(B, N, H, dk, lo=0.5) if case.kind == "kda" else r(B, N, H, lo=0.5)
        return dict(q=r(B, N, Hk, dk), k=r(B, N, Hk, dk), v=r(B, N, H, dv), g=g,
                    b=torch.rand(B, N, H, generator=gen, dtype=torch.float64))
    if case.kind == "linear":
        return dict(q=r(B, N, Hk, dk), k=r(B, N, Hk, dk), v=r(B, N, H, dv), g=r(B, N, H, lo=0.5))
    if case.kind == "ssd":
        return dict(x=r(B, N, H, dv), d=torch.rand(B, N, H, generator=gen, dtype=torch.float64) + 0.1,
                    B=r(B, N, Hk, dk), C=r(B, N, Hk, dk), A=r(H, lo=1.0), D=r(H))
    if case.kind == "lightning":
        return dict(q=r(B, N, H, dk), k=r(B, N, H, dk), v=r(B, N, H, dv),
                    s=torch.rand(H, generator=gen, dtype=torch.float64))
    return dict(x=r(B, N, 5), w=r(5, 1, 4), c=r(5))


def cu_of(case: RecCase) -> Optional[list]:
    N = case.local_seq * case.world
    return [0, 3, 4, N // 2 + 1, N] if case.packed else None


def apply(case: RecCase, t: dict, **kw):
    """``(out, final state or None)`` of the case's recurrence; ``kw`` empty means the oracle."""
    ref = not kw
    if not ref and case.kind != "conv":
        kw["scheme"] = case.scheme
    if "S0" in t:
        kw["initial_state"] = t["S0"]
    if case.kind == "conv":
        if ref:
            cu = cu_of(case) or [0, t["x"].shape[1]]
            y = torch.cat([F.conv1d(t["x"][:, a:e].transpose(1, 2), t["w"], t["c"], padding=3,
                                    groups=5)[..., :e - a].transpose(1, 2) for a, e in zip(cu, cu[1:])], 1)
            return F.silu(y), None
        return rec.sp_causal_conv1d(t["x"], t["w"], t["c"], activation="silu", **kw), None
    resets = doc_starts(t[next(iter(t))].shape[1], cu_of(case)) if ref else None
    if case.kind in ("gdn", "kda"):
        if ref:
            q, k = (t[n].repeat_interleave(2, dim=2) for n in "qk")
            return rec.recurrent_reference(q, k, t["v"], t["g"], t["b"], use_qk_l2norm=True, resets=resets, **kw)
        return rec.sp_gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["b"], use_qk_l2norm=True,
                                       chunk_size=2, output_final_state=True, **kw)
    if case.kind == "linear":
        if ref:
            q, k = (t[n].repeat_interleave(2, dim=2) for n in "qk")
            return rec.recurrent_reference(q, k, t["v"], t["g"], None, scale=0.5, resets=resets, **kw)
        return rec.sp_linear_attention(t["q"], t["k"], t["v"], t["g"], scale=0.5, chunk_size=2,
                                       output_final_state=True, **kw)
    if case.kind == "ssd":
        if ref:
            Bh, Ch = (t[n].repeat_interleave(2, dim=2) for n in "BC")
            y, S = rec.recurrent_reference(Ch, Bh * t["d"].unsqueeze(-1), t["x"], t["d"] * t["A"], None,
                                           resets=resets, **kw)
            return y + t["x"] * t["D"].view(1, 1, -1, 1), S
        return rec.sp_ssd(t["x"], t["d"], t["A"], t["B"], t["C"], t["D"], chunk_size=2,
                          output_final_state=True, **kw)
    g = (-t["s"]).view(1, 1, -1).expand(t["q"].shape[0], t["q"].shape[1], -1)
    if ref:
        return rec.recurrent_reference(t["q"], t["k"], t["v"], g, None, resets=resets, **kw)
    return rec.sp_lightning_attention(t["q"], t["k"], t["v"], t["s"], chunk_size=4, output_final_state=True, **kw)


def one_case(case: RecCase) -> dict:
    """Relative errors (out, final state, every input's gradient) against the float64 oracle."""
    full = inputs(case)
    gen = torch.Generator().manual_seed(case.seed + 1)
    ref_in = {n: x.clone().requires_grad_() for n, x in full.items()}
    ref_out, ref_S = apply(case, ref_in)
    dout = torch.randn(ref_out.shape, generator=gen, dtype=torch.float64)
    dS = None if ref_S is None else torch.randn(ref_S.shape, generator=gen, dtype=torch.float64)
    loss = (ref_out * dout).sum() + (0 if dS is None else (ref_S * dS).sum())
    loss.backward()
    layout = random_partition(case.local_seq * case.world, case.world, case.seed) \
        if case.layout == "partition" else case.layout
    dtype = getattr(torch, case.dtype)
    mine = {n: (burstattn.shard_sequence(x, layout=layout) if n in SHARDED[case.kind] else x)
            .to(dtype).detach().requires_grad_() for n, x in full.items()}
    out, S = apply(case, mine, layout=layout, cu_seqlens=cu_of(case))
    loss = (out.double() * burstattn.shard_sequence(dout, layout=layout)).sum()
    if S is not None:
        loss = loss + (S.double() * dS).sum()  # only the owner's copy carries a gradient
    loss.backward()
    errs = {"out": rel_err(burstattn.gather_sequence(out.detach(), layout=layout), ref_out.detach())}
    if S is not None:
        errs["state"] = rel_err(S.detach(), ref_S.detach())
    for n, x in mine.items():
        grad = x.grad.double()
        if n in SHARDED[case.kind]:
            grad = burstattn.gather_sequence(grad, layout=layout)
        elif n != "S0":  # the initial state's gradient is whole on every rank; a parameter's is a part
            dist.all_reduce(grad)
        errs["d" + n] = rel_err(grad, ref_in[n].grad)
    return errs


def bad_input(case: RecCase) -> str:
    """A rank-dependent bad call: rank 1 passes ``chunk_size=0`` (or a different packing); every rank must raise."""
    t = {n: burstattn.shard_sequence(x, layout=case.layout) if n in SHARDED[case.kind] else x
         for n, x in inputs(case).items()}
    rank = dist.get_rank()
    try:
        if case.kind == "gdn":
            rec.sp_gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["b"], layout=case.layout,
                                    chunk_size=0 if rank == 1 else 2)
        elif case.kind == "linear":
            N = case.local_seq * case.world
            rec.sp_linear_attention(t["q"], t["k"], t["v"], t["g"], layout=case.layout,
                                    cu_seqlens=[0, 2 if rank == 1 else 3, N])
        else:
            rec.sp_causal_conv1d(t["x"][..., : 4 if rank == 1 else 5], t["w"], layout=case.layout)
    except ValueError as e:
        return f"ValueError: {e}"
    return "no error"


def metered(case: RecCase) -> dict:
    """Bytes this rank sent, by (phase, op), for one delta-rule call and one convolution, forward and backward."""
    t = {n: burstattn.shard_sequence(x, layout=case.layout).requires_grad_() for n, x in inputs(
        RecCase("gdn", case.layout, "float32", case.world)).items()}
    x = burstattn.shard_sequence(inputs(RecCase("conv", case.layout, "float32", case.world))["x"],
                                 layout=case.layout).requires_grad_()
    w = torch.randn(5, 4, dtype=torch.float64)
    with burstattn.comm_stats() as stats:
        o, _ = rec.sp_gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["b"], layout=case.layout, chunk_size=2)
        y = rec.sp_causal_conv1d(x, w, layout=case.layout)
        (o.sum() + y.sum()).backward()
    return {f"{p}/{op}": stats.sent(p, op) for p in ("forward", "backward") for op in ("state", "dstate", "halo",
                                                                                          "dhalo")}


def run_grid(rank: int, world: int, rows: list) -> list:
    """Per row: the error dict, or ``"Type: message"``; rows of ``("bad", case)`` run :func:`bad_input`,
    rows of ``("bytes", case)`` :func:`metered`."""
    results = []
    for row in rows:
        try:
            results.append((bad_input if row[0] == "bad" else metered)(row[1]) if isinstance(row, tuple)
                           else one_case(row))
        except Exception as e:  # reported per row by the parent
            results.append(f"{type(e).__name__}: {e}")
    return results

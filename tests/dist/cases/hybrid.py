"""Sequence-parallel recurrences and convolutions over a real group, and the hybrid model built on them.

Each rank builds the same full inputs, shards them, runs the sequence-parallel recurrence (with its
final state), backpropagates ``sum(o * dout) + sum(final * dS)`` and gathers the gradients; the float64
token-by-token recurrence on the full sequence is the oracle. A replicated parameter's gradient
(Mamba2's ``A``/``D``, lightning's ``slope``, the convolution's weight and bias) is the sum over ranks of
their partial gradients.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

import burstattn
from burstattn import recurrent as rec
from burstattn.models import AttnCall, HybridLlama, preset
from burstattn.config import IGNORE_INDEX
from burstattn.recurrent.segments import doc_starts
from tests.dist.cases.attention import random_partition
from tests.helpers import rel_err


# ---- every recurrence x layout x packing x dtype (test_recurrent.py, unit/test_recurrent_schemes.py) ----
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
    docs: int = 0  # > 0: this many packed documents of random lengths (instead of ``packed``'s four)


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
    if case.docs:  # document starts drawn without replacement from 1 .. N - 1
        gen = torch.Generator().manual_seed(case.seed + 11)
        starts = (torch.randperm(N - 1, generator=gen)[:case.docs - 1] + 1).sort().values.tolist()
        return [0] + starts + [N]
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


def recurrence_errors(case: RecCase) -> dict:
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
        elif n != "S0" and dist.is_initialized():  # the initial state's gradient is whole on every rank; a parameter's is a part
            dist.all_reduce(grad)
        errs["d" + n] = rel_err(grad, ref_in[n].grad)
    return errs


def bad_input(case: RecCase) -> str:
    """A rank-dependent bad call: rank 1 passes ``chunk_size=0`` (or a different packing, a scheme that
    does not exist, an initial state of the wrong shape); every rank must raise."""
    t = {n: burstattn.shard_sequence(x, layout=case.layout) if n in SHARDED.get(case.kind, "x") else x
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
        elif case.kind == "scheme":  # a scheme that does not exist, on one rank
            t = {n: burstattn.shard_sequence(x, layout=case.layout) for n, x in inputs(
                RecCase("gdn", case.layout, "float64", case.world)).items()}
            rec.sp_gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["b"], layout=case.layout,
                                    scheme="ring" if rank == 1 else "scan")
        elif case.kind == "initial":  # an initial state of the wrong shape, on one rank
            t = {n: burstattn.shard_sequence(x, layout=case.layout) if n in SHARDED["ssd"] else x
                 for n, x in inputs(RecCase("ssd", case.layout, "float64", case.world)).items()}
            S0 = torch.zeros(2, 2, 3 if rank == 1 else 4, 3, dtype=torch.float64)
            rec.sp_ssd(t["x"], t["d"], t["A"], t["B"], t["C"], initial_state=S0, layout=case.layout)
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


def scheme_gap(case: RecCase) -> dict:
    """Relative differences between the scan and the all-gather on the same inputs: out, final
    state and every input's gradient (this rank's shards)."""
    full = inputs(case)
    layout = random_partition(case.local_seq * case.world, case.world, case.seed) \
        if case.layout == "partition" else case.layout
    runs = []
    for scheme in ("allgather", "scan"):
        mine = {n: (burstattn.shard_sequence(x, layout=layout) if n in SHARDED[case.kind] else x)
                .detach().requires_grad_() for n, x in full.items()}
        out, S = apply(RecCase(**{**case.__dict__, "scheme": scheme}), mine, layout=layout, cu_seqlens=cu_of(case))
        gen = torch.Generator().manual_seed(case.seed + 3)
        (out * torch.randn(out.shape, generator=gen, dtype=out.dtype)).sum().add(
            (S * torch.randn(S.shape, generator=gen, dtype=S.dtype)).sum()).backward()
        runs.append({"out": out.detach(), "state": S.detach(), **{"d" + n: x.grad for n, x in mine.items()}})
    return {k: rel_err(runs[1][k], v) for k, v in runs[0].items()}


def fold_kept(case: RecCase) -> dict:
    """Bytes the state passing's fold keeps for the backward on this rank (zigzag, one document),
    per scheme: the storages its saved tensors hold, less the summaries themselves."""
    from torch.autograd.graph import saved_tensors_hooks

    from burstattn.groups import group_context
    from burstattn.recurrent.schemes import Packer, fold_allgather, fold_scan, route
    from burstattn.recurrent.segments import segment_plan
    b, H, dk, dv = 1, 2, 8, 4
    seg = segment_plan(2 * case.world * 2, case.world, "zigzag")
    ctx = group_context(None)
    out = {}
    for scheme, fold in (("allgather", fold_allgather), ("scan", fold_scan)):
        gen = torch.Generator().manual_seed(case.seed)
        mine = {i: (torch.randn(b, H, dk, dk, generator=gen).requires_grad_(),
                    torch.randn(b, H, dk, dv, generator=gen).requires_grad_()) for i in range(len(seg.offsets[ctx.rank]))}
        inputs_ = {t.untyped_storage().data_ptr() for pair in mine.values() for t in pair}
        kept = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in inputs_:
                kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        token = mine[0][1].reshape(-1)[0] * 0
        with saved_tensors_hooks(pack, lambda t: t):
            before, _, tie = fold(route(seg, scheme, False), ctx, mine, Packer(b, H, (dk, dk), dk, dv), final=False,
                                  initial=None, token=token)
        loss = sum(v.sum() for v in before.values() if v is not None) + (0 if tie is None else tie)
        loss.backward()
        out[scheme] = sum(kept.values())
    return out


def metered_state(case: RecCase) -> dict:
    """``{"phase/op": [bytes sent, records]}`` of one delta-rule call (the case's scheme, documents,
    final state and initial state with a gradient when ``initial``), forward and backward."""
    full = inputs(RecCase("gdn", case.layout, "float32", case.world, local_seq=case.local_seq, seed=case.seed))
    t = {n: burstattn.shard_sequence(x, layout=case.layout).requires_grad_() for n, x in full.items()}
    kw = dict(layout=case.layout, chunk_size=4, scheme=case.scheme, cu_seqlens=cu_of(case),
              output_final_state=case.initial)
    if case.initial:
        kw["initial_state"] = torch.zeros(2, 2, 4, 3, requires_grad=True)
    with burstattn.comm_stats() as stats:
        o, S = rec.sp_gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["b"], **kw)
        (o.sum() + (S.sum() if S is not None else 0)).backward()
    table = stats.as_dict()
    return {f"{p}/{op}": [table.get(p, {}).get(op, {}).get("sent", 0), table.get(p, {}).get(op, {}).get("msgs", 0)]
            for p, op in (("forward", "state"), ("backward", "dstate"))}


def recurrence_grid(rank: int, world: int, rows: list) -> list:
    """Per row: the error dict, or ``"Type: message"``; rows of ``("bad", case)`` run :func:`bad_input`,
    rows of ``("bytes", case)`` :func:`metered`, ``("state", case)`` :func:`metered_state`, ``("gap", case)``
    :func:`scheme_gap`, ``("kept", case)`` :func:`fold_kept`."""
    results = []
    kinds = {"bad": bad_input, "bytes": metered, "state": metered_state, "gap": scheme_gap, "kept": fold_kept}
    for row in rows:
        try:
            results.append(kinds[row[0]](row[1]) if isinstance(row, tuple) else recurrence_errors(row))
        except Exception as e:  # reported per row by the parent
            results.append(f"{type(e).__name__}: {e}")
    return results


BAD_FAMILY = {  # case -> what the bad rank's message names
    "ssd_groups": "multiple of the groups", "ssd_dt": "dt must be", "ssd_A": "A must be", "ssd_D": "D must be",
    "ssd_B_none": "B must be a tensor", "lightning_slope": "slope [heads]", "kda_g": "per channel",
    "gdn_beta": "beta must be a tensor", "linear_int": "v must be floating point", "kernel": "kernel='fla'",
    "conv_weight": "weight must be a tensor", "conv_int": "x must be floating point",
}


def bad_family(case: RecCase, what: str) -> str:
    """``"ValueError: message"`` of a call whose input is bad on the last rank only (``"no error"``)."""
    last = dist.get_rank() == dist.get_world_size() - 1
    lay = case.layout

    def shards(kind):
        return {n: burstattn.shard_sequence(x, layout=lay) if n in SHARDED[kind] else x
                for n, x in inputs(RecCase(kind, lay, "float64", case.world)).items()}
    try:
        if what.startswith("ssd"):
            t = shards("ssd")
            B, C, dt, A, D = t["B"], t["C"], t["d"], t["A"], t["D"]
            if last:
                B, C = (x.expand(-1, -1, 3, -1) for x in (B, C)) if what == "ssd_groups" else (B, C)
                dt = dt[..., :1] if what == "ssd_dt" else dt
                A, D = (A[:1] if what == "ssd_A" else A), (D.view(1, -1) if what == "ssd_D" else D)
                B = None if what == "ssd_B_none" else B
            rec.sp_ssd(t["x"], dt, A, B, C, D, layout=lay)
        elif what == "lightning_slope":
            t = shards("lightning")
            rec.sp_lightning_attention(t["q"], t["k"], t["v"], t["s"][:1] if last else t["s"], layout=lay)
        elif what in ("kda_g", "gdn_beta", "kernel"):
            t = shards("kda" if what == "kda_g" else "gdn")
            g = t["g"][..., 0] if last and what == "kda_g" else t["g"]
            beta = t["b"].tolist() if last and what == "gdn_beta" else t["b"]
            fn = rec.sp_kda if what == "kda_g" else rec.sp_gated_delta_rule
            fn(t["q"], t["k"], t["v"], g, beta, layout=lay, kernel="fla" if last and what == "kernel" else "auto")
        elif what == "linear_int":
            t = shards("linear")
            rec.sp_linear_attention(t["q"], t["k"], t["v"].long() if last else t["v"], t["g"], layout=lay)
        else:
            t = shards("conv")
            x = t["x"].long() if last and what == "conv_int" else t["x"]
            rec.sp_causal_conv1d(x, None if last and what == "conv_weight" else t["w"], t["c"], layout=lay)
    except ValueError as e:
        return f"ValueError: {e}"
    return "no error"


def run_bad_family(rank: int, world: int, whats) -> dict:
    """:func:`bad_family` for each case (zigzag), ``{case: message}``."""
    return {what: bad_family(RecCase("ssd", "zigzag", "float64", world), what) for what in whats}


# ---- hybrid-tiny in float64 (test_hybrid_train.py) -----------------------------------------------
# One forward and backward over the context-parallel ranks; the loss and every parameter's gradient
# (summed over ranks).
def grads64(rank: int, world: int, strategy: str, layout: str, packed: bool = False) -> dict:
    torch.manual_seed(0)
    cfg = preset("hybrid-tiny").with_overrides(linear_chunk=4)
    model = HybridLlama(cfg, attn=AttnCall(strategy, layout=layout, options={"backend": "reference"})).double()
    N = 24
    tokens = torch.randint(0, cfg.vocab_size, (2, N), generator=torch.Generator().manual_seed(1))
    labels = torch.cat([tokens[:, 1:], torch.full((2, 1), IGNORE_INDEX)], 1)
    pos = burstattn.sequence_positions(N, layout=layout)
    out = model(tokens[:, pos], pos, labels=labels[:, pos],
                total_targets=int((labels != IGNORE_INDEX).sum()))
    out.loss.backward()
    loss = out.loss.detach().clone()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    if world > 1:
        dist.all_reduce(loss)
        for g in grads.values():
            dist.all_reduce(g)
    return dict(loss=float(loss), grads=grads if rank == 0 else None)


def documents_alone(rank: int, world: int, cfg) -> float:
    """The step-0 loss of ``cfg``'s documents (``--doc-lengths`` / ``--data`` with boundaries) with the
    initial weights ``burstattn train`` builds, each document run alone through the model on one process
    (no packing, no dispatch): the sum of every document's cross-entropy over the batch's targets."""
    from burstattn.train import build_job
    from burstattn.train.dispatch_step import make_documents

    job = build_job(cfg)
    docs = make_documents(cfg).documents(0)
    total = sum(int(d.numel()) - 1 for d in docs)  # a document's last token has no target
    loss = 0.0
    with torch.no_grad():
        for d in docs:
            labels = torch.cat([d[1:], torch.full((1,), IGNORE_INDEX)])
            out = job.model(d[None], torch.arange(d.numel()), attn=AttnCall("burst"), labels=labels[None],
                            total_targets=total)
            loss += float(out.loss)
    return loss

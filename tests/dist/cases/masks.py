"""Masks over a real group: the masks the tests use (``mask_mod`` functions, document ids), masked calls
against the float64 oracle, refusals, and every strategy on :func:`burstattn.mask_partition`'s partition.
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch

import burstattn
from burstattn.masks import AttnMask, mask_bytes, mask_plan
from burstattn.testing.oracle import exact_attention
from tests.helpers import Case, full_inputs, rel_err


# ---- masks and masked calls (test_masked_attention.py) -------------------------------------------
def local_global(q_pos, k_pos):
    """Block-sparse local + global: blocks of 8 see themselves; every token sees the first 4."""
    return (q_pos // 8 == k_pos // 8) | (k_pos < 4)


def some_rows_blind(q_pos, k_pos):
    """Every 5th query row sees no key at all (tests output 0 / LSE -inf, no NaN)."""
    return (q_pos % 5 != 0) & (k_pos >= 0)


def strided(q_pos, k_pos):
    """A strided pattern: keys at the same residue mod 3, plus the diagonal."""
    return ((q_pos - k_pos) % 3 == 0) | (q_pos == k_pos)


def raises(q_pos, k_pos):
    raise RuntimeError("boom from mask_mod")


def not_bool(q_pos, k_pos):
    return (q_pos - k_pos).float()


def doc_ids(seq_len: int) -> torch.Tensor:
    """Documents as ids: lengths 1, 3, then the rest split in two uneven runs."""
    cut = [0, 1, 4, 4 + (seq_len - 4) // 3, seq_len]
    ids = torch.empty(seq_len, dtype=torch.int64)
    for i in range(len(cut) - 1):
        ids[cut[i]:cut[i + 1]] = 10 * i + 7  # ids need not be 0..D-1
    return ids


def mask_kwargs(kind: str, seq_len: int) -> dict:
    """The keyword arguments of one mask kind for a global sequence of ``seq_len`` tokens."""
    n8 = max(seq_len // 8, 1)
    table = {
        "window": dict(window=(n8 + 1, 2)),
        "window_causal": dict(window=(n8, 0)),
        "window_zero": dict(window=(0, 0)),
        "window_left_only": dict(window=(3, None)),
        "window_wide": dict(window=(10 * seq_len, 10 * seq_len)),
        "docs": dict(cu_seqlens=[0, 1, 3, seq_len // 2 + 3, seq_len - 2, seq_len]),
        "one_doc": dict(cu_seqlens=[0, seq_len]),
        "doc_ids": dict(document_ids=doc_ids(seq_len)),
        "docs_window": dict(cu_seqlens=[0, seq_len // 3, seq_len], window=(5, 1)),
        "local_global": dict(mask_mod=local_global),
        "blind_rows": dict(mask_mod=some_rows_blind),
        "strided": dict(mask_mod=strided),
    }
    return table[kind]


def build(kind: str, seq_len: int, block_size: int) -> AttnMask:
    return AttnMask(block_size=block_size, **mask_kwargs(kind, seq_len))


def reference(case: Case, kind: str, block_size: int) -> dict:
    """Float64 dense oracle with the same mask: out, lse, dq, dk, dv over the full sequence."""
    q, k, v, dout = full_inputs(case)
    n = case.seq_len
    dense = build(kind, n, block_size).dense(torch.arange(n), torch.arange(n), n, case.causal)
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    out, lse = exact_attention(q64, k64, v64, causal=case.causal, softmax_scale=case.softmax_scale, mask=dense)
    out.backward(dout.double())
    return dict(out=out.detach(), lse=lse.detach(), dq=q64.grad, dk=k64.grad, dv=v64.grad)


def layout_of(case: Case, kind: str):
    """A named layout, or ``"documents"``: the document-aware partition of the mask's documents."""
    if case.layout != "documents":
        return case.layout
    from burstattn.layouts.partition import document_partition
    return document_partition(mask_kwargs(kind, case.seq_len)["cu_seqlens"], case.world, causal=case.causal)


def masked(rank: int, world: int, case: Case, kind: str, block_size: int, via: str = "mask",
           strategy: str = "burst") -> dict:
    """Forward (with LSE for burst) + backward under the mask; the bytes sent and the formula's bytes
    (the sparse plan's for burst / ring, the strategy's dense formula for the others)."""
    q, k, v, dout = full_inputs(case)
    layout = layout_of(case, kind)
    pos = burstattn.sequence_positions(case.seq_len, layout=layout) if isinstance(layout, str) \
        else layout.positions_of(rank)
    shards = [x.index_select(1, pos).detach().clone().requires_grad_(i < 3) for i, x in enumerate((q, k, v, dout))]
    q, k, v, dout = shards
    amask = build(kind, case.seq_len, block_size)
    kw = dict(mask=amask) if via == "mask" else mask_kwargs(kind, case.seq_len)
    with burstattn.comm_stats() as stats:
        if strategy == "burst":
            out, lse = burstattn.burst_attn_func(q, k, v, causal=case.causal, softmax_scale=case.softmax_scale,
                                                 layout=layout, return_lse=True, backend=case.backend,
                                                 backward=case.backward, **kw)
        else:
            out, lse = burstattn.attention(q, k, v, strategy=strategy, causal=case.causal,
                                           softmax_scale=case.softmax_scale, layout=layout,
                                           backend=case.backend, **kw), None
        out.backward(dout)
    sent = stats.sent_by_op()
    plan = mask_plan(amask, case.causal, case.seq_len, world, layout, rank)
    backward = "kv" if strategy == "ring" else case.backward
    if strategy in ("allgather", "ulysses"):
        formula = burstattn.strategies.STRATEGIES[strategy].bytes_formula()(
            batch=case.batch, local_seq=case.local_seq, world_size=world, q_heads=case.q_heads,
            kv_heads=case.kv_heads, head_dim=case.head_dim, dtype=q.dtype)
        return dict(out=out.detach(), lse=lse, dq=q.grad, dk=k.grad, dv=v.grad, positions=pos, sent=sent,
                    formula=formula["ops"] if world > 1 else {}, steps=None)
    if backward == "auto":
        from burstattn.masks import choose_mask_backward
        backward = choose_mask_backward(batch=case.batch, local_seq=case.local_seq, q_heads=case.q_heads,
                                        kv_heads=case.kv_heads, head_dim=case.head_dim, dtype=q.dtype)
    formula = mask_bytes(plan, batch=case.batch, local_seq=case.local_seq, q_heads=case.q_heads,
                         kv_heads=case.kv_heads, head_dim=case.head_dim, dtype=q.dtype, backward=backward)
    if world == 1:
        formula = {"ops": {}}
    return dict(out=out.detach(), lse=lse, dq=q.grad, dk=k.grad, dv=v.grad, positions=pos, sent=sent,
                formula=formula["ops"], steps=len(plan.kv_steps()))


def bad_mask(rank: int, world: int, kwargs: dict, only_rank: Optional[int] = None) -> tuple[str, str]:
    """A call with a bad mask (on every rank, or only on ``only_rank``): exception type and message."""
    case = Case(world=world, local_seq=8, layout="contiguous")
    q, k, v, _ = full_inputs(case)
    n = case.local_seq
    q, k, v = (x[:, rank * n:(rank + 1) * n] for x in (q, k, v))
    use = kwargs if only_rank is None or only_rank == rank else {}
    try:
        burstattn.burst_attn_func(q, k, v, layout="contiguous", backend="reference", **use)
    except (TypeError, ValueError) as e:
        return type(e).__name__, str(e)
    return "no error", ""


def masked_docs_aligned(rank: int, world: int, case: Case) -> dict:
    """Documents aligned to shard boundaries (two per shard): the bytes and steps of one call."""
    q, k, v, dout = full_inputs(case)
    n = case.local_seq
    cu = sorted({0, case.seq_len} | {r * n for r in range(world)} | {r * n + n // 2 for r in range(world)})
    q, k, v, dout = (x[:, rank * n:(rank + 1) * n].detach().clone().requires_grad_(i < 3)
                     for i, x in enumerate((q, k, v, dout)))
    with burstattn.comm_stats() as stats:
        out = burstattn.burst_attn_func(q, k, v, causal=True, layout="contiguous", backend=case.backend,
                                        cu_seqlens=cu)
        out.backward(dout)
    sent = sum(b for (_, op), b in stats.sent_by_op().items() if op != "meta")
    plan = mask_plan(AttnMask(cu_seqlens=cu), True, case.seq_len, world, "contiguous", rank)
    return dict(kv_sent=sent, steps=len(plan.kv_steps()), out=out.detach())


# ---- every strategy on mask_partition's partition (test_mask_partition_strategies.py) ------------
# Every strategy that takes a partition and a mask, against the float64 dense oracle.
PARTITION_KINDS = ("window_causal", "docs", "local_global", "strided")  # windows, documents, block-sparse, mask_mod
PARTITION_STRATEGIES = ("burst", "ring", "allgather", "ulysses")


def partitioned(rank: int, world: int, case: Case, kind: str, strategy: str, block: int) -> dict:
    """Relative errors of this rank's out, dq, dk, dv shards, and the partition's fingerprint."""
    amask = build(kind, case.seq_len, block)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tiny shapes: balance is not the point here, exactness is
        part = burstattn.mask_partition(amask, case.seq_len, world, causal=case.causal)
    pos = part.positions_of(rank)
    q, k, v, dout = (x.index_select(1, pos).detach().clone().requires_grad_(i < 3)
                     for i, x in enumerate(full_inputs(case)))
    opts = dict(backward=case.backward) if strategy == "burst" else {}
    out = burstattn.attention(q, k, v, strategy=strategy, causal=case.causal, layout=part, mask=amask,
                              backend=case.backend, **opts)
    out.backward(dout)
    ref = reference(case, kind, block)
    got = dict(out=out, dq=q.grad, dk=k.grad, dv=v.grad)
    errs = {n: rel_err(got[n].detach(), ref[n].index_select(1, pos)) for n in got}
    return dict(errs=errs, fingerprint=part.fingerprint, name=part.name)


def partitioned_grid(rank: int, world: int, rows: list) -> list:
    """``rows`` of ``(case, kind, strategy, block)`` -> per row the result or ``"Type: message"``."""
    results = []
    for case, kind, strategy, block in rows:
        try:
            results.append(partitioned(rank, world, case, kind, strategy, block))
        except Exception as e:  # reported per row by the parent
            results.append(f"{type(e).__name__}: {e}")
    return results

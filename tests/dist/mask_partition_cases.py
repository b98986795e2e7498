"""Rank side of tests/dist/test_mask_partition.py: every strategy that takes a partition and a mask,
on :func:`burstattn.mask_partition`'s partition, against the float64 dense oracle (module-level, so it
pickles into the session pools)."""
from __future__ import annotations

import warnings

import torch

import burstattn
from tests.dist import mask_cases
from tests.helpers import Case, full_inputs, rel_err

KINDS = ("window_causal", "docs", "local_global", "strided")  # windows, documents, block-sparse, mask_mod
STRATEGIES = ("burst", "ring", "allgather", "ulysses")


def one(rank: int, world: int, case: Case, kind: str, strategy: str, block: int) -> dict:
    """Relative errors of this rank's out, dq, dk, dv shards, and the partition's fingerprint."""
    amask = mask_cases.build(kind, case.seq_len, block)
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
    ref = mask_cases.reference(case, kind, block)
    got = dict(out=out, dq=q.grad, dk=k.grad, dv=v.grad)
    errs = {n: rel_err(got[n].detach(), ref[n].index_select(1, pos)) for n in got}
    return dict(errs=errs, fingerprint=part.fingerprint, name=part.name)


def grid(rank: int, world: int, rows: list) -> list:
    """``rows`` of ``(case, kind, strategy, block)`` -> per row the result or ``"Type: message"``."""
    results = []
    for case, kind, strategy, block in rows:
        try:
            results.append(one(rank, world, case, kind, strategy, block))
        except Exception as e:  # reported per row by the parent
            results.append(f"{type(e).__name__}: {e}")
    return results

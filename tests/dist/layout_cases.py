"""Rank side of tests/dist/test_layouts.py: what a new user does, for every strategy and layout.

``shard_sequence(x, layout=L)`` -> ``attention(..., strategy=S, layout=L)`` -> ``gather_sequence(out, layout=L)``,
then the gradients of the shards gathered the same way; the parent compares with float64 attention.
"""
from __future__ import annotations

import torch

import burstattn
from burstattn.comm.groups import SUBGROUPS
from tests.helpers import Case, full_inputs, reference_results, rel_err

USP_DEGREES = {2: (2, 1), 3: (3, 1), 4: (2, 2)}  # world -> (ulysses_degree, ring_degree)


def random_partition(seq_len: int, world: int, seed: int = 0) -> burstattn.Partition:
    """Any assignment: a random permutation cut into ``world`` sorted, equal parts."""
    perm = torch.randperm(seq_len, generator=torch.Generator().manual_seed(seed))
    return burstattn.Partition(tuple(p.sort().values for p in perm.view(world, -1)), name="random")


def layout_of(name: str, case: Case):
    return random_partition(case.seq_len, case.world) if name == "partition" else (
        None if name == "none" else name)


def one_case(case: Case, strategy: str, layout_name: str) -> dict:
    """Relative errors of out, dq, dk, dv against the float64 reference (all ranks see the same)."""
    layout = layout_of(layout_name, case)
    kw = {} if layout is None else dict(layout=layout)  # None: every function's own default
    q, k, v, dout = full_inputs(case)
    q, k, v = (burstattn.shard_sequence(x, **kw).detach().requires_grad_() for x in (q, k, v))
    opts = {}
    if strategy == "usp":
        opts = dict(zip(("ulysses_degree", "ring_degree"), USP_DEGREES[case.world]))
    out = burstattn.attention(q, k, v, strategy=strategy, causal=case.causal, backend=case.backend,
                              layout=layout, **opts)
    full = burstattn.gather_sequence(out, **kw)
    # every rank computes the same loss; gather_sequence's backward sums them: divide by P
    (full.double() * dout.double()).sum().div(case.world).backward()
    got = dict(out=full.detach(), **{f"d{n}": burstattn.gather_sequence(t.grad, **kw)
                                     for n, t in zip("qkv", (q, k, v))})
    ref = reference_results(case)
    return {name: rel_err(got[name], ref[name]) for name in ("out", "dq", "dk", "dv")}


def run_grid(rank: int, world: int, rows: list) -> list:
    """``rows`` of ``(case, strategy, layout name)`` -> per row the errors or ``"Type: message"``."""
    results = []
    try:
        for case, strategy, layout_name in rows:
            try:
                results.append(one_case(case, strategy, layout_name))
            except Exception as e:  # reported per row by the parent
                results.append(f"{type(e).__name__}: {e}")
    finally:
        import torch.distributed as dist

        for entry in SUBGROUPS.entries.values():  # usp's cached sub-groups: made here, destroyed here
            for g in (entry.ulysses_group, entry.ring_group):
                if g is not None:
                    dist.destroy_process_group(g)
        SUBGROUPS.clear()
    return results

"""Rank-side function of tests/dist/test_low_precision.py: one fp16/bf16 call, forward + backward,
with the kernel's gradient partials in float32 (the default) or as the kernel returns them."""
from __future__ import annotations

import burstattn
from tests.helpers import Case, full_inputs


def run(rank: int, world: int, case: Case, grad_partials: str = "float32") -> dict:
    """This rank's shard of out, lse, dq, dk, dv (and its global positions)."""
    shards = [burstattn.shard_sequence(x, layout=case.layout).detach().clone().requires_grad_(i < 3)
              for i, x in enumerate(full_inputs(case))]
    q, k, v, dout = shards
    out, lse = burstattn.burst_attn_func(q, k, v, causal=case.causal, layout=case.layout, backend=case.backend,
                                         backward=case.backward, return_lse=True, grad_partials=grad_partials)
    out.backward(dout)
    return dict(out=out.detach(), lse=lse, dq=q.grad, dk=k.grad, dv=v.grad,
                positions=burstattn.sequence_positions(case.seq_len, layout=case.layout))


def run_many(rank: int, world: int, cases: list, grad_partials: str = "float32") -> list:
    """:func:`run` for every case (one pool call)."""
    return [run(rank, world, c, grad_partials) for c in cases]

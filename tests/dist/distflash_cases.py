"""Rank-side functions for the DistFlashAttn schedule tests (run inside the session pools)."""
from __future__ import annotations

import burstattn
from tests.dist.cases import sharded_leaves
from tests.helpers import Case


def distflash(rank: int, world: int, case: Case) -> dict:
    """Forward (with LSE) and backward under ``schedule="distflash"``, with the bytes sent."""
    q, k, v, dout = sharded_leaves(case)
    with burstattn.comm_stats() as stats:
        out, lse = burstattn.burst_attn_func(q, k, v, causal=True, layout="contiguous", schedule="distflash",
                                             return_lse=True, backend=case.backend,
                                             softmax_scale=case.softmax_scale)
        out.backward(dout)
    sent = stats.sent_by_op()
    return dict(out=out.detach(), lse=lse, dq=q.grad, dk=k.grad, dv=v.grad, sent=sent)


def distflash_bad(rank: int, world: int, kwargs: dict) -> tuple[str, str]:
    """A distflash call with bad options: the exception type and message on this rank."""
    case = Case(world=world, local_seq=8)
    q, k, v, _ = sharded_leaves(case)
    try:
        burstattn.burst_attn_func(q, k, v, schedule="distflash", **kwargs)
    except (TypeError, ValueError) as e:
        return type(e).__name__, str(e)
    return "no error", ""


def double_ring(rank: int, world: int, case: Case, ranks_per_node: int) -> dict:
    """Forward (with LSE) and backward under ``schedule="double"``, with the bytes sent."""
    topo = burstattn.two_level_groups(ranks_per_node)
    q, k, v, dout = sharded_leaves(case)
    try:
        with burstattn.comm_stats() as stats:
            out, lse = burstattn.burst_attn_func(q, k, v, causal=case.causal, layout=case.layout, schedule="double",
                                                 topology=topo, return_lse=True, backend=case.backend,
                                                 backward=case.backward)
            out.backward(dout)
    finally:  # the sub-groups made for this case
        import torch.distributed as dist
        for g in (topo.inner_group, topo.outer_group):
            if g is not None:
                dist.destroy_process_group(g)
    sent = stats.sent_by_op()
    return dict(out=out.detach(), lse=lse, dq=q.grad, dk=k.grad, dv=v.grad, sent=sent)

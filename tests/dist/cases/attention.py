"""Functions run on every rank of a pool (module-level so they pickle by reference).

Each takes ``(rank, world_size, ...)`` and returns plain tensors / values; the parent asserts.
"""
from __future__ import annotations

import os

import torch

import burstattn
from burstattn.layouts.named import local_positions
from tests.helpers import Case, full_inputs


def sharded_leaves(case: Case) -> tuple[torch.Tensor, ...]:
    q, k, v, dout = full_inputs(case)
    shards = [burstattn.shard_sequence(x, layout=case.layout) for x in (q, k, v, dout)]
    return tuple(s.detach().clone().requires_grad_(i < 3) for i, s in enumerate(shards))


def attention(rank: int, world: int, case: Case) -> dict:
    """Forward with return_lse and backward of a fixed grad_out on this rank's shard."""
    assert world == case.world
    q, k, v, dout = sharded_leaves(case)
    out, lse = burstattn.burst_attn_func(q, k, v, causal=case.causal, softmax_scale=case.softmax_scale,
                                         layout=case.layout, return_lse=True, backend=case.backend,
                                         backward=case.backward)
    out.backward(dout)
    return dict(out=out.detach(), lse=lse, lse_requires_grad=lse.requires_grad, dq=q.grad, dk=k.grad,
                dv=v.grad, positions=burstattn.sequence_positions(case.seq_len, layout=case.layout))


def comm_bytes(rank: int, world: int, case: Case) -> dict:
    """Byte meter of one forward + backward."""
    q, k, v, dout = sharded_leaves(case)
    with burstattn.comm_stats() as stats:
        out = burstattn.burst_attn_func(q, k, v, causal=case.causal, layout=case.layout,
                                        backend=case.backend, backward=case.backward)
        out.backward(dout)
    return stats.as_dict()


def traced(rank: int, world: int, case: Case) -> list[dict]:
    """Trace events of one forward + backward."""
    q, k, v, dout = sharded_leaves(case)
    with burstattn.trace_steps() as trace:
        out = burstattn.burst_attn_func(q, k, v, causal=case.causal, layout=case.layout,
                                        backend=case.backend, backward=case.backward)
        out.backward(dout)
    return trace.events


def module_vs_func(rank: int, world: int, case: Case) -> dict:
    """BurstAttention(...)(q, k, v) and burst_attn_func on the same shard, with gradients."""
    results = {}
    for kind in ("func", "module"):
        q, k, v, dout = sharded_leaves(case)
        kw = dict(causal=case.causal, softmax_scale=case.softmax_scale, layout=case.layout,
                  backend=case.backend, backward=case.backward)
        out = (burstattn.burst_attn_func(q, k, v, **kw) if kind == "func"
               else burstattn.BurstAttention(**kw)(q, k, v))
        out.backward(dout)
        results[kind] = [out.detach(), q.grad, k.grad, v.grad]
    return results


def dtypes_out(rank: int, world: int, dtype: str, backend: str) -> tuple:
    """Output / lse dtypes and shapes for one input dtype; no grad -> no saved tensors needed."""
    case = Case(world=world, local_seq=8, batch=2, heads="gqa", head_dim=16, dtype=dtype, backend=backend)
    q, k, v, _ = (x.detach() for x in sharded_leaves(case))
    out, lse = burstattn.burst_attn_func(q, k, v, layout=case.layout, backend=backend, return_lse=True)
    plain = burstattn.burst_attn_func(q, k, v, layout=case.layout, backend=backend)
    return (out.dtype, tuple(out.shape), lse.dtype, tuple(lse.shape), lse.requires_grad,
            isinstance(plain, torch.Tensor), bool(torch.equal(plain, out)))


def shard_gather(rank: int, world: int, layout: str, dim: int) -> dict:
    """shard -> gather round trip, and the gradient of gather (sum over ranks of each rank's grad)."""
    gen = torch.Generator().manual_seed(7)
    shape = [3, 4, 5]
    shape[dim] = 2 * world * 3
    full = torch.randn(shape, generator=gen)
    local = burstattn.shard_sequence(full, layout=layout, dim=dim).detach().requires_grad_()
    gathered = burstattn.gather_sequence(local, layout=layout, dim=dim)
    weights = [torch.randn(shape, generator=gen) for _ in range(world)]  # the same list on every rank
    (gathered * weights[rank]).sum().backward()
    seq_dim = dim % len(shape)
    return dict(full=full, local=local.detach(), gathered=gathered.detach(), grad=local.grad,
                weights=weights, positions=burstattn.sequence_positions(shape[seq_dim], layout=layout),
                expected_positions=local_positions(shape[seq_dim], rank, world, layout))


# ---- bad inputs --------------------------------------------------------------------------------
def _bad_args(scenario: str, rank: int, world: int) -> tuple[tuple, dict]:
    """Arguments of burst_attn_func for ``scenario``; ``@1`` suffix: only rank 1 is bad."""
    name, _, only = scenario.partition("@")
    bad = not only or rank == int(only)
    b, n, hq, hkv, d = 2, 8, 4, 2, 16
    q, k, v = torch.randn(b, n, hq, d), torch.randn(b, n, hkv, d), torch.randn(b, n, hkv, d)
    kw = dict(layout="zigzag", backend="reference", backward="auto", causal=True)
    if not bad or name == "none":
        return (q, k, v), kw
    if name == "ndim":
        q = q[0]
    elif name == "not_tensor":
        q = q.tolist()
    elif name == "batch":
        k, v = k[:1], v[:1]
    elif name == "head_dim":
        k, v = k[..., :8], v[..., :8]
    elif name == "dtype_mix":
        k = k.to(torch.bfloat16)
    elif name == "dtype_rank":
        q, k, v = (x.to(torch.bfloat16) for x in (q, k, v))
    elif name == "device":
        k = k.to("meta")
    elif name == "heads":
        q = torch.randn(b, n, 3, d)
    elif name == "local_seq":
        q, k, v = (torch.cat([x, x], dim=1) for x in (q, k, v))
    elif name == "zigzag_odd":
        q, k, v = (x[:, :7] for x in (q, k, v))
    elif name == "layout":
        kw["layout"] = "diagonal"
    elif name == "backend":
        kw["backend"] = "triton"
    elif name == "backward":
        kw["backward"] = "both"
    elif name in ("flash_attn", "sdpa"):
        kw["backend"] = name
    elif name == "causal":
        kw["causal"] = False
    elif name == "softmax_scale":
        kw["softmax_scale"] = -1.0
    else:
        raise AssertionError(f"unknown scenario {scenario}")
    return (q, k, v), kw


def bad_input(rank: int, world: int, scenario: str) -> tuple[str, str]:
    """Call burst_attn_func with the scenario's arguments; return (exception type, message)."""
    args, kw = _bad_args(scenario, rank, world)
    try:
        burstattn.burst_attn_func(*args, **kw)
    except (ValueError, TypeError) as exc:
        return type(exc).__name__, str(exc)
    return "no error", ""


def bad_shard(rank: int, world: int, layout: str, seq_len: int) -> tuple[str, str]:
    """shard_sequence of a length the layout cannot split."""
    try:
        burstattn.shard_sequence(torch.zeros(1, seq_len, 2), layout=layout)
    except (ValueError, TypeError) as exc:
        return type(exc).__name__, str(exc)
    return "no error", ""


# ---- a peer that disappears --------------------------------------------------------------------
def vanish(rank: int, world: int, when: str) -> str:
    """Rank 1 exits abruptly (``when``: "before" the call, or "mid" at its second kernel call)."""
    case = Case(world=world, local_seq=16, heads="mha", layout="zigzag", backend="reference", causal=True)
    q, k, v, dout = sharded_leaves(case)
    if rank == 1 and when == "before":
        os._exit(17)
    if rank == 1 and when == "mid":
        from burstattn.kernels.plain import PlainKernel
        real, calls = PlainKernel.forward, []

        def dying(self, *a, **kw):
            calls.append(1)
            if len(calls) == 2:
                os._exit(17)
            return real(self, *a, **kw)

        PlainKernel.forward = dying  # only in this rank's process
    out = burstattn.burst_attn_func(q, k, v, causal=True, layout="zigzag", backend="reference")
    out.backward(dout)
    return "finished"


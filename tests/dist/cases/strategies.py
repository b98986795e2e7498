"""Every strategy through ``attention(strategy=...)`` over a real group: values, bytes, peaks, refusals;
head-chunked attention; the simulator's peak and time measurements of one call.

Each function takes ``(rank, world_size, ...)`` and returns plain tensors / values; the parent asserts.
"""
from __future__ import annotations

import time

import torch

import burstattn
from burstattn.comm.groups import usp_groups
from burstattn.layouts.named import local_positions
from burstattn.meter.memory import measure_peak
from burstattn.models.head_chunks import head_chunked_attention
from burstattn.strategies.usp import usp_positions
from tests.helpers import Case, full_inputs


# ---- one strategy on a Case's shard (test_strategies.py) -----------------------------------------
def positions(case: Case, strategy: str, ulysses_degree: int, rank: int) -> torch.Tensor:
    """Global positions ``rank`` holds: the layout over the group, or USP's grid layout."""
    if strategy != "usp":
        return local_positions(case.seq_len, rank, case.world, case.layout)
    ring_rank, ulysses_rank = divmod(rank, ulysses_degree)
    return usp_positions(case.seq_len, ring_rank=ring_rank, ring_degree=case.world // ulysses_degree,
                         ulysses_rank=ulysses_rank, ulysses_degree=ulysses_degree, layout=case.layout)


def _usp_options(world: int, ulysses_degree: int, build: str) -> dict:
    """USP's options, its groups built the way ``build`` says ("groups", "mesh" or "degrees")."""
    ring_degree = world // ulysses_degree
    if build == "groups":
        g = usp_groups(ulysses_degree, ring_degree)
        return dict(ulysses_group=g.ulysses_group, ring_group=g.ring_group)
    if build == "mesh":
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (ring_degree, ulysses_degree), mesh_dim_names=("ring", "ulysses"))
        return dict(mesh=mesh)
    return dict(ulysses_degree=ulysses_degree, ring_degree=ring_degree)


def destroy_usp_groups(opts: dict) -> None:
    """Destroy the sub-groups a case made (given groups, a mesh's, or the cached ones of degrees)."""
    import torch.distributed as dist

    from burstattn.comm.groups import SUBGROUPS

    if "mesh" in opts:
        groups = [opts["mesh"].get_group(name) for name in ("ring", "ulysses")]
    elif "ulysses_group" in opts:
        groups = [opts["ulysses_group"], opts["ring_group"]]
    else:
        groups = [g for e in SUBGROUPS.entries.values() for g in (e.ulysses_group, e.ring_group)]
        SUBGROUPS.clear()
    for g in groups:
        if g is not None and g is not dist.group.WORLD:
            dist.destroy_process_group(g)


def _leaves(case: Case, pos: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(x.index_select(1, pos).detach().clone().requires_grad_(i < 3)
                 for i, x in enumerate(full_inputs(case)))


def run_strategy(rank: int, world: int, case: Case, strategy: str, ulysses_degree: int = 1,
                 build: str = "groups") -> dict:
    """One forward + backward of ``strategy`` on this rank's shard, with the byte meter."""
    assert world == case.world
    pos = positions(case, strategy, ulysses_degree, rank)
    q, k, v, dout = _leaves(case, pos)
    opts = _usp_options(world, ulysses_degree, build) if strategy == "usp" else {}
    try:
        with burstattn.comm_stats() as stats:
            out = burstattn.attention(q, k, v, strategy=strategy, causal=case.causal,
                                      softmax_scale=case.softmax_scale, layout=case.layout, backend=case.backend,
                                      **opts)
            out.backward(dout)
    finally:
        destroy_usp_groups(opts)
    sent = stats.sent_by_op()
    return dict(out=out.detach(), dq=q.grad, dk=k.grad, dv=v.grad, positions=pos, sent=sent)


def peak_memory(rank: int, world: int, strategy: str, local_seq: int) -> int:
    """Peak bytes of one forward + backward on this rank (allocator events; see bench/memory.py)."""
    case = Case(world=world, local_seq=local_seq, heads="2/2", head_dim=8, layout="contiguous",
                backend="reference" if strategy == "rsa" else "cpu_flash")
    q, k, v, dout = _leaves(case, local_positions(case.seq_len, rank, world, case.layout))

    def step() -> None:
        burstattn.attention(q, k, v, strategy=strategy, layout=case.layout, backend=case.backend).backward(dout)

    step()  # warm-up: lazily created buffers are not what we measure
    return measure_peak(step)[1].peak_bytes


# ---- bad inputs ----------------------------------------------------------------------------------
def _bad_call(scenario: str, rank: int, world: int) -> tuple[str, tuple, dict]:
    """``(strategy, (q, k, v), options)`` for ``scenario``; ``@1`` suffix: only rank 1 is bad."""
    name, _, only = scenario.partition("@")
    bad = not only or rank == int(only)
    heads = (3, 1) if name.endswith("_heads") and bad else (4, 2)
    q, k, v = torch.randn(1, 8, heads[0], 16), torch.randn(1, 8, heads[1], 16), torch.randn(1, 8, heads[1], 16)
    calls = {
        "unknown_strategy": ("nope", {}),
        "option": ("rsa", dict(backward="kv")),
        "usp_option_typo": ("usp", dict(ulysses=2)),
        "layout_unsupported": ("rsa", dict(layout=burstattn.Partition(tuple(
            local_positions(8 * world, r, world, "striped") for r in range(world)), name="mine"))),
        "layout_unknown": ("tp", dict(layout="diagonal")),
        "rsa_backend": ("rsa", dict(backend="cpu_flash")),
        "ulysses_heads": ("ulysses", {}),
        "tp_heads": ("tp", {}),
        "usp_heads": ("usp", dict(ulysses_degree=world, ring_degree=1)),
        "usp_degrees": ("usp", dict(ulysses_degree=2, ring_degree=world)),
        "usp_missing": ("usp", {}),
        "usp_both": ("usp", dict(mesh=object(), ulysses_group=object(), ring_group=object())),
        "allgather_ndim": ("allgather", {}),
        "ulysses_kvheads": ("ulysses", {}),
    }
    strategy, kw = calls[name]
    kw = {"layout": "contiguous", "backend": "reference", "causal": True, **kw}
    if name == "usp_degrees" and not bad:
        kw.update(ulysses_degree=world, ring_degree=1)
    if name == "allgather_ndim" and bad:
        q = q[0]
    if name == "ulysses_kvheads" and bad:
        k, v = k[:, :, :1].expand(1, 8, 3, 16), v[:, :, :1].expand(1, 8, 3, 16)
    return strategy, (q, k, v), kw


def bad_input(rank: int, world: int, scenario: str) -> tuple[str, str]:
    """Call attention() with the scenario's arguments; return (exception type, message)."""
    strategy, args, kw = _bad_call(scenario, rank, world)
    try:
        burstattn.attention(*args, strategy=strategy, **kw)
    except (ValueError, TypeError) as exc:
        return type(exc).__name__, str(exc)
    return "no error", ""


# ---- head-chunked attention (test_head_chunks.py) ------------------------------------------------
def run_chunked(rank: int, world: int, rows: list) -> list[dict]:
    """Every ``(case, strategy, chunks, ulysses_degree, extras)`` row: forward + backward through
    :func:`head_chunked_attention` on this rank's shard, with the byte meter. ``extras``: per-head
    options to pass (``"alibi"``: slopes ``[Hq]``, ``"sinks"``: sinks ``[Hq]``, both differentiable)."""
    out = []
    for case, strategy, chunks, u, extras in rows:
        assert world == case.world
        pos = positions(case, strategy, u, rank)
        q, k, v, dout = _leaves(case, pos)
        opts = _usp_options(world, u, "degrees") if strategy == "usp" else {}
        gen = torch.Generator().manual_seed(7)
        per_head = {}
        if "alibi" in extras:
            per_head["alibi_slopes"] = torch.rand(case.q_heads, generator=gen, dtype=torch.float32)
        if "sinks" in extras:
            per_head["sinks"] = torch.randn(case.q_heads, generator=gen, dtype=torch.float32).requires_grad_()
        try:
            with burstattn.comm_stats() as stats:
                o = head_chunked_attention(q, k, v, chunks=chunks, strategy=strategy, causal=case.causal,
                                           layout=case.layout, backend=case.backend, **opts, **per_head)
                o.backward(dout)
        finally:
            destroy_usp_groups(opts)
        sinks = per_head.get("sinks")
        out.append(dict(out=o.detach(), dq=q.grad, dk=k.grad, dv=v.grad, positions=pos, stats=stats.as_dict(),
                        dsinks=None if sinks is None else sinks.grad))
    return out


def call_peak(rank: int, world: int, strategy: str, chunks: int, local_seq: int, heads: tuple, head_dim: int) -> int:
    """Peak bytes of one forward + backward through :func:`head_chunked_attention` beyond its inputs
    (``bench.memory.measure_peak``: the allocator's peak over the call, float32), the smallest of 3
    repeats (tests/helpers.py's band rule: gloo's worker thread frees the all-to-all buffers late at
    times; one full CI run measured ulysses' 4 groups 2 shards above the usual)."""
    gen = torch.Generator().manual_seed(rank)
    hq, hkv = heads
    q = torch.randn(1, local_seq, hq, head_dim, generator=gen).requires_grad_()
    k = torch.randn(1, local_seq, hkv, head_dim, generator=gen).requires_grad_()
    v = torch.randn(1, local_seq, hkv, head_dim, generator=gen).requires_grad_()
    dout = torch.randn(1, local_seq, hq, head_dim, generator=gen)

    def step():
        o = head_chunked_attention(q, k, v, chunks=chunks, strategy=strategy, causal=True, layout="zigzag",
                                   backend="cpu_flash")
        o.backward(dout)
        return None

    step()  # warm: communicators and caches exist before the measured call
    peaks = []
    for _ in range(3):
        q.grad = k.grad = v.grad = None
        peaks.append(measure_peak(step)[1].peak_bytes)
    return int(min(peaks))


# ---- the simulator's measurements of one call (test_sim_library.py) ------------------------------
def attention_peak(rank: int, world: int, strategy: str, n: int, hq: int, hkv: int, d: int, causal: bool,
                   options: dict, repeats: int = 0, memory_repeats: int = 1) -> dict:
    """Peak bytes of one fwd+bwd of ``strategy`` on this rank (inputs existing before: q, k, v and
    dO): ``peak`` the smallest of ``memory_repeats`` measurements, ``peak_max`` the largest; ``buffers``
    the bytes of the call's collective inputs (bounded above by the bytes sent x P / (P - 1): an
    all-to-all sends (P-1)/P of its input, a gather P-1 times it); and the fastest fwd / fwd+bwd
    seconds of ``repeats`` timed calls."""
    import burstattn
    from burstattn.meter.memory import measure_peak
    from burstattn.strategies import attention

    gen = torch.Generator().manual_seed(rank)
    q = torch.randn(1, n, hq, d, generator=gen).requires_grad_()
    k, v = (torch.randn(1, n, hkv, d, generator=gen).requires_grad_() for _ in "kv")
    grad = torch.randn(1, n, hq, d, generator=gen)

    def fwd_bwd():
        attention(q, k, v, strategy=strategy, causal=causal, **options).backward(grad)
        q.grad = k.grad = v.grad = None

    with burstattn.comm_stats() as stats:
        fwd_bwd()
    peaks = [measure_peak(fwd_bwd)[1].peak_bytes for _ in range(memory_repeats)]
    times = {"fwd": [], "fwd+bwd": []}
    for _ in range(repeats):
        torch.distributed.barrier()
        t0 = time.perf_counter()
        with torch.no_grad():
            attention(q, k, v, strategy=strategy, causal=causal, **options)
        torch.distributed.barrier()
        t1 = time.perf_counter()
        fwd_bwd()
        torch.distributed.barrier()
        times["fwd"].append(t1 - t0)
        times["fwd+bwd"].append(time.perf_counter() - t1)
    fastest = {k: min(v) for k, v in times.items() if v}  # other processes only ever slow a repeat down
    buffers = stats.sent() * world / max(world - 1, 1)
    return {"peak": min(peaks), "peak_max": max(peaks), "buffers": buffers, "times": fastest}

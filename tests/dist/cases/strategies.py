"""Rank-side functions of tests/dist/test_strategies.py (module-level so they pickle by reference).

Each takes ``(rank, world_size, ...)`` and returns plain tensors / values; the parent asserts.
"""
from __future__ import annotations

import torch

import burstattn
from burstattn.comm.groups import usp_groups
from burstattn.layouts.named import local_positions
from burstattn.meter.memory import measure_peak
from burstattn.strategies.usp import usp_positions
from tests.helpers import Case, full_inputs


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


# ---- bad inputs --------------------------------------------------------------------------------
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

"""One attention call over a real group: values, bytes, trace, shards, refusals, a vanishing peer, the
registered op (compile, checkpoint, double backward), 16-bit inputs, every layout, the DistFlashAttn
and double-ring schedules.

Each function takes ``(rank, world_size, ...)`` and returns plain tensors / values; the parent asserts.
"""
from __future__ import annotations

import os

import torch

import burstattn
from burstattn import ops
from burstattn.comm.groups import SUBGROUPS
from burstattn.layouts.named import local_positions
from tests.helpers import Case, full_inputs, reference_results, rel_err


# ---- burst_attn_func on a Case's shard (test_attention.py, test_api.py, test_validation.py, test_faults.py) ----
def sharded_leaves(case: Case) -> tuple[torch.Tensor, ...]:
    q, k, v, dout = full_inputs(case)
    shards = [burstattn.shard_sequence(x, layout=case.layout) for x in (q, k, v, dout)]
    return tuple(s.detach().clone().requires_grad_(i < 3) for i, s in enumerate(shards))


def forward_backward(rank: int, world: int, case: Case) -> dict:
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


# ---- bad inputs ----------------------------------------------------------------------------------
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


# ---- a peer that disappears ----------------------------------------------------------------------
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


# ---- the registered op: compile, checkpoint, double backward (test_ops.py) -----------------------
def _shards(case: Case, layout: str):
    return [burstattn.shard_sequence(x, layout=layout).detach().clone().requires_grad_(i < 3)
            for i, x in enumerate(full_inputs(case))]


def compiled_vs_eager(rank: int, world: int, strategy: str, backend: str) -> dict:
    """``torch.compile(fullgraph=True)`` of a function calling the attention, forward + backward,
    against the same function run eagerly: max abs differences of out, dq, dk, dv."""
    torch._dynamo.reset()
    case = Case(world=world, local_seq=8, heads="gqa", head_dim=16, causal=True)
    layout = "contiguous" if strategy == "ring" else "zigzag"
    opts: dict = {"usp": dict(ulysses_degree=2), "usp-ring": dict(ring_degree=2)}.get(strategy, {})
    strategy = strategy.split("-")[0]

    def fn(q, k, v):
        if strategy == "burst_attn_func":
            out = burstattn.burst_attn_func(q, k, v, causal=True, layout=layout, backend="reference")
        else:
            out = burstattn.attention(q, k, v, strategy=strategy, causal=True, layout=layout, backend="reference",
                                      **opts)
        return (out * 2).sin()

    results = []
    for run in (fn, torch.compile(fn, fullgraph=True, backend=backend)):
        q, k, v, dout = _shards(case, layout)
        out = run(q, k, v)
        out.backward(dout)
        results.append([out.detach(), q.grad, k.grad, v.grad])
    return {name: float((a - b).abs().max()) for name, a, b in zip(("out", "dq", "dk", "dv"), *results)}


def checkpoint_forwards(rank: int, world: int, policy: str) -> dict:
    """Forward passes of the op (counted by the input checks it runs, one per forward) in one
    forward + backward of a checkpointed block, and the gradients (equal in every mode)."""
    from torch.utils.checkpoint import checkpoint

    case = Case(world=world, local_seq=8, heads="mha", head_dim=16, causal=True)
    q, k, v, dout = _shards(case, "zigzag")

    def block(q, k, v):
        return burstattn.burst_attn_func(q.sin(), k, v, causal=True, backend="reference").cos()

    with burstattn.comm_stats() as stats:
        if policy == "none":
            out = block(q, k, v)
        elif policy == "plain":
            out = checkpoint(block, q, k, v, use_reentrant=False)
        else:
            out = checkpoint(block, q, k, v, use_reentrant=False, context_fn=ops.save_attention_context())
        out.backward(dout)
    forwards = stats.as_dict()["forward"]["meta"]["msgs"] if world > 1 else None
    return dict(forwards=forwards, dq=q.grad, dk=k.grad, dv=v.grad)


def double_backward(rank: int, world: int, path: str) -> str:
    """The error of a second-order gradient through the op (``path="op"``) or the eager
    function (``"mask_mod"``), as ``"ExcType: message"``."""
    case = Case(world=world, local_seq=8, heads="mha", head_dim=16, dtype="float64")
    q, k, v, _ = _shards(case, "zigzag")
    extra = dict(mask_mod=lambda qp, kp: kp <= qp + 100) if path == "mask_mod" else {}
    out = burstattn.burst_attn_func(q, k, v, backend="reference", **extra)
    try:  # the op refuses at the second backward; the eager function already at the first one
        (g,) = torch.autograd.grad(out.sum(), q, create_graph=True)
        g.sum().backward()
    except RuntimeError as e:
        return f"RuntimeError: {e}"
    return "no error"


# ---- 16-bit inputs (test_low_precision.py) -------------------------------------------------------
# One fp16/bf16 call, forward + backward, with the kernel's gradient partials in float32 (the default)
# or as the kernel returns them.
def low_precision(rank: int, world: int, case: Case, grad_partials: str = "float32") -> dict:
    """This rank's shard of out, lse, dq, dk, dv (and its global positions)."""
    shards = [burstattn.shard_sequence(x, layout=case.layout).detach().clone().requires_grad_(i < 3)
              for i, x in enumerate(full_inputs(case))]
    q, k, v, dout = shards
    out, lse = burstattn.burst_attn_func(q, k, v, causal=case.causal, layout=case.layout, backend=case.backend,
                                         backward=case.backward, return_lse=True, grad_partials=grad_partials)
    out.backward(dout)
    return dict(out=out.detach(), lse=lse, dq=q.grad, dk=k.grad, dv=v.grad,
                positions=burstattn.sequence_positions(case.seq_len, layout=case.layout))


def low_precision_many(rank: int, world: int, cases: list, grad_partials: str = "float32") -> list:
    """:func:`low_precision` for every case (one pool call)."""
    return [low_precision(rank, world, c, grad_partials) for c in cases]


# ---- every strategy x layout, as a new user calls it (test_layouts.py) ---------------------------
# ``shard_sequence(x, layout=L)`` -> ``attention(..., strategy=S, layout=L)`` -> ``gather_sequence(out, layout=L)``,
# then the gradients of the shards gathered the same way; the parent compares with float64 attention.
USP_DEGREES = {2: (2, 1), 3: (3, 1), 4: (2, 2)}  # world -> (ulysses_degree, ring_degree)


def random_partition(seq_len: int, world: int, seed: int = 0) -> burstattn.Partition:
    """Any assignment: a random permutation cut into ``world`` sorted, equal parts."""
    perm = torch.randperm(seq_len, generator=torch.Generator().manual_seed(seed))
    return burstattn.Partition(tuple(p.sort().values for p in perm.view(world, -1)), name="random")


def layout_of(name: str, case: Case):
    return random_partition(case.seq_len, case.world) if name == "partition" else (
        None if name == "none" else name)


def layout_errors(case: Case, strategy: str, layout_name: str) -> dict:
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


def layout_grid(rank: int, world: int, rows: list) -> list:
    """``rows`` of ``(case, strategy, layout name)`` -> per row the errors or ``"Type: message"``."""
    results = []
    try:
        for case, strategy, layout_name in rows:
            try:
                results.append(layout_errors(case, strategy, layout_name))
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


# ---- the DistFlashAttn and double-ring schedules (test_distflash.py) -----------------------------
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


def vanish_before_collective(rank: int, world: int, where: str) -> str:
    """Rank 1 exits before an exchange every rank enters (``where``: ``"all_gather"``, the metered
    collective of ``comm.collectives``; ``"recurrence"``: a sequence-parallel linear attention's state
    exchange, its input check off)."""
    import torch.distributed as dist

    from burstattn.comm.collectives import Collectives
    from burstattn.recurrent import sp_linear_attention

    if rank == 1:
        os._exit(17)
    if where == "all_gather":
        Collectives(dist.group.WORLD, "forward").all_gather(torch.ones(4), "probe")
    else:
        q = torch.randn(1, 8, 2, 4)
        sp_linear_attention(q, q, q, -torch.rand(1, 8, 2), check=False)
    return "finished"

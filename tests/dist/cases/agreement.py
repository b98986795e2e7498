"""What every rank must agree on: :mod:`burstattn.comm.agree` itself, arguments whose values differ
between ranks, and the traps of a group (a mask that differs or raises mid-ring, sub-groups reused, a
rank outside the group, NaN on one rank). Each function returns values or the error this rank raised, so
the parent can check that every rank raised the same.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

import burstattn
from burstattn.comm.groups import SUBGROUPS


# ---- burstattn.comm.agree (test_agree_every_rank.py, test_train_same_run.py) ---------------------
# Each returns ``(exception type name, message)`` or ``("no error", "")``.
def exchange(rank: int, world: int, kind: str) -> tuple[str, str]:
    """One :func:`agree` call in which ``kind`` differs: ``same``, ``value`` (the last rank's seed),
    ``alone`` (the function and a shape differ), ``problem`` (rank 1's own), ``problems`` (TypeError on
    rank 1, ValueError on the last rank), ``every`` (the same problem on every rank)."""
    from burstattn.comm.agree import agree, entries
    from burstattn.comm.stats import CommStats

    sig = {"function": "f", "seed": 1, "heads": 4}
    problem = None
    if kind == "value" and rank == world - 1:
        sig["seed"] = 2
    if kind == "alone" and rank == 0:
        sig.update(function="g", heads=8)
    if kind == "problem" and rank == 1:
        problem = "q must be 4-D"
    if kind == "problems" and rank in (1, world - 1):
        problem = (TypeError, f"bad dtype {rank}") if rank == 1 else (ValueError, "bad shape")
    if kind == "every":
        problem = "bad everywhere"
    try:
        stats = CommStats()
        agree("check", entries(sig), dist.group.WORLD, problem=problem, alone=("function",), stats=stats)
    except Exception as e:  # noqa: BLE001 - the type is the result
        return type(e).__name__, str(e)
    return "no error", str(stats.sent("forward", "meta"))


def _site_qkv(n: int, seed: int = 3):
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, n, 2, 8, generator=g, dtype=torch.float64) for _ in range(3)]


def site(rank: int, world: int, name: str) -> tuple[str, str]:
    """One library check that compares across ranks, called with an input that is wrong on one rank (or
    differs on the last rank): ``(exception type name, message)`` or ``("no error", "")``."""
    import torch

    import burstattn
    from burstattn import recurrent as rec
    from burstattn.comm.groups import group_context
    from burstattn.infer.generate import generate
    from burstattn.masks.setup import GuardedMaskMod, raise_mask_failures
    from burstattn.train.dispatch_step import check_same_batch

    last = rank == world - 1
    world_group = dist.group.WORLD
    try:
        if name == "attention_shapes":  # the last rank's shard is longer
            q, k, v = _site_qkv(6 if last else 4)
            burstattn.burst_attn_func(q, k, v, causal=True, backend="reference", layout="contiguous")
        elif name == "attention_problem":  # rank 1's q is 3-D
            q, k, v = _site_qkv(4)
            burstattn.burst_attn_func(q[0] if rank == 1 else q, k, v, causal=True, backend="reference")
        elif name == "attention_strategy":  # the last rank calls another strategy
            q, k, v = _site_qkv(4)
            burstattn.attention(q, k, v, strategy="ring" if last else "burst", causal=True)
        elif name == "delta_rule":  # the last rank's chunk size differs
            g = torch.Generator().manual_seed(5)
            q, k, v = (torch.randn(1, 4, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
            gate = -torch.rand(1, 4, 2, generator=g, dtype=torch.float64)
            beta = torch.rand(1, 4, 2, generator=g, dtype=torch.float64)
            rec.sp_gated_delta_rule(q, k, v, gate, beta, chunk_size=4 if last else 2)
        elif name == "conv":  # the last rank's convolution is wider
            x = torch.randn(1, 4, 3, dtype=torch.float64)
            rec.sp_causal_conv1d(x, torch.randn(3, 5 if last else 4, dtype=torch.float64))
        elif name == "generate":  # the last rank's prompt differs in one token
            from tests.dist.cases.models import tiny_model

            prompt = torch.arange(8).view(1, 8)
            generate(tiny_model(0), prompt + int(last), 2, backend="reference", group=world_group)
        elif name == "dispatch":  # the last rank's global batch has another length
            check_same_batch([5, 7, 9 + int(last)], world_group)
        elif name == "mask_mod":  # the predicate failed on rank 1 during the pass
            guard = GuardedMaskMod(lambda q, k: q >= k)
            guard.failure = "mask_mod raised IndexError: out of range" if rank == 1 else None
            raise_mask_failures(guard, group_context(world_group))
        elif name == "hf_batch":  # the last rank's full batch differs
            from burstattn.hf.batch import checked_plan

            ids = torch.arange(16).view(2, 8) + int(last)
            checked_plan("shard_batch", ids, group=world_group)
        elif name == "hf_cache":  # the last rank fed other tokens
            from burstattn.hf import ShardedCache

            keys = torch.ones(1, 2, 3, 4) * (2.0 if last else 1.0)
            ShardedCache(world_group)._check_same_tokens(keys)
        else:
            raise KeyError(name)
    except Exception as e:  # noqa: BLE001 - the type is the result
        return type(e).__name__, str(e)
    return "no error", ""

def train_flags(rank: int, world: int, field: str, values: list) -> tuple[str, str]:
    """``build_job`` on a TrainConfig whose ``field`` is ``values[rank]`` on this rank (what flags that
    differ between launched ranks give)."""
    from burstattn.train import TrainConfig, build_job

    try:
        build_job(TrainConfig(model="tiny", seq_len=120, batch=2, steps=1, **{field: values[rank]}))
    except Exception as e:  # noqa: BLE001 - the type is the result
        return type(e).__name__, str(e)
    return "no error", ""


# ---- values that differ between ranks (test_crossrank.py) ----------------------------------------
# ALiBi slopes, sink logits, and a ``requires_grad`` that differs between ranks.
# Each returns ``(exception type name, message)`` or ``("no error", "")``.
def _rank_seeded_qkv(rank: int, world: int, grad: bool, heads: int = 4):
    g = torch.Generator().manual_seed(11 + rank)
    n = 4  # tokens per rank (zigzag: two chunks of 2)
    q, k, v = (torch.randn(1, n, heads, 8, generator=g, dtype=torch.float64).requires_grad_(grad)
               for _ in range(3))
    return q, k, v


def differing(rank: int, world: int, kind: str, strategy: str = "burst_attn_func") -> tuple[str, str]:
    """One call whose ``kind`` (``alibi``, ``sinks``, ``requires_grad``, ``same``) differs on rank 0:
    the forward (and, where this rank asks for one, the backward) of ``strategy``."""
    q, k, v = _rank_seeded_qkv(rank, world, grad=(rank == 0) if kind == "requires_grad" else False)
    kw = {}
    if kind == "alibi":
        kw["alibi_slopes"] = torch.full((4,), 0.5 if rank == 0 else 1.5, dtype=torch.float64)
    elif kind == "sinks":
        kw["sinks"] = torch.full((4,), 0.25 if rank == 0 else -1.0, dtype=torch.float64)
    try:
        if strategy == "burst_attn_func":
            out = burstattn.burst_attn_func(q, k, v, causal=True, backend="reference", **kw)
        else:
            out = burstattn.attention(q, k, v, strategy=strategy, causal=True, **kw)
        if out.requires_grad:
            out.sum().backward()
    except (TypeError, ValueError) as e:
        return type(e).__name__, str(e)
    return "no error", ""


# ---- traps of a group (test_traps_every_rank.py) -------------------------------------------------
# Each scenario returns ``"ok"``-like values or the error this rank raised as ``"Type: message"``.
def _error(fn) -> str:
    try:
        fn()
    except Exception as e:  # the parent asserts the type and words
        return f"{type(e).__name__}: {e}"
    return "no error"


def _qkv(n: int = 16, heads: int = 2, dtype=torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, n, heads, 16, generator=gen, dtype=dtype).requires_grad_() for _ in range(3))


def mask_disagreement(rank: int, world: int) -> list[str]:
    """A prefix mask of 8 keys on rank 0, 40 on the others (same plans at this size), then masks
    whose plans differ: both must raise on every rank (never a silent answer, never a hang)."""
    q, k, v = _qkv()
    limit = 8 if rank == 0 else 40
    same_plan = _error(lambda: burstattn.burst_attn_func(q, k, v, layout="contiguous",
                                                         mask_mod=lambda qp, kp: kp < limit))
    other = 3 if rank == 0 else 20
    other_plan = _error(lambda: burstattn.burst_attn_func(q, k, v, mask_mod=lambda qp, kp: kp < other))
    return [same_plan, other_plan]


class FlakyMask:
    """``(q_pos - k_pos) % 3 != 1``, a pattern with partial blocks; raises on rank 1 once armed."""

    def __init__(self, rank: int) -> None:
        self.rank, self.armed = rank, False

    def __call__(self, qp, kp):
        if self.armed and self.rank == 1:
            raise RuntimeError("flaky predicate")
        return (qp - kp) % 3 != 1


def mask_raises_mid_ring(rank: int, world: int) -> list[str]:
    """A module with a cached mask: the second call's plan comes from the cache, so the predicate
    runs only inside the ring (partial blocks); when it raises on one rank, every rank must raise."""
    fn = FlakyMask(rank)
    attn = burstattn.BurstAttention(causal=True, mask_mod=fn, backend="reference")
    q, k, v = _qkv()
    first = _error(lambda: attn(q, k, v).sum().backward())
    fn.armed = True
    second = _error(lambda: attn(q, k, v))
    fn.armed = False
    third = _error(lambda: attn(q, k, v).sum().backward())  # the group is still usable
    return [first, second, third]


def usp_group_reuse(rank: int, world: int) -> dict:
    """The README one-liner called repeatedly: sub-groups built once (same objects, no new fds)."""
    q, k, v = _qkv(n=8, heads=4)
    seen, fds = [], []
    for _ in range(4):
        burstattn.attention(q, k, v, strategy="usp", ulysses_degree=2, ring_degree=2).sum().backward()
        seen.append(tuple(id(g) for e in SUBGROUPS.entries.values() for g in (e.ulysses_group, e.ring_group)))
        fds.append(len(os.listdir("/proc/self/fd")))
    entries = len(SUBGROUPS.entries)
    for e in list(SUBGROUPS.entries.values()):
        for g in (e.ulysses_group, e.ring_group):
            dist.destroy_process_group(g)
    SUBGROUPS.clear()
    # growth after the first call: a rebuilt pair of sub-groups opens at least one socket per peer
    # per group (>= 2); a descriptor opened or closed meanwhile by something else moves it by one
    return dict(same_groups=len(set(seen)) == 1, entries=entries, fd_growth=max(fds[1:]) - fds[1])


def outside_group(rank: int, world: int) -> list[str]:
    """Rank ``world - 1`` is not in ``group``: shard_sequence / sequence_positions / gather say so."""
    group = dist.new_group(list(range(world - 1)))
    x = torch.arange(24.0).view(1, 24)
    try:
        if rank < world - 1:
            return ["member"]
        return [_error(lambda: burstattn.shard_sequence(x, group=group)),
                _error(lambda: burstattn.sequence_positions(24, group=group)),
                _error(lambda: burstattn.gather_sequence(x, group=group))]
    finally:
        dist.destroy_process_group(group)


def different_strategies(rank: int, world: int) -> str:
    q, k, v = _qkv()
    strategy = "burst" if rank == 0 else "ring"
    return _error(lambda: burstattn.attention(q, k, v, strategy=strategy, causal=True))


def module_topology_and_lse(rank: int, world: int) -> dict:
    """BurstAttention(schedule="double", topology=...) runs and equals the flat ring; return_lse works."""
    topo = burstattn.two_level_groups(2)
    try:
        q, k, v = _qkv()
        out, lse = burstattn.BurstAttention(causal=True, schedule="double", topology=topo, return_lse=True)(q, k, v)
        want, want_lse = burstattn.burst_attn_func(q, k, v, causal=True, return_lse=True)
        return dict(out=float((out - want).abs().max()), lse=float((lse - want_lse).abs().max()))
    finally:
        for g in (topo.inner_group, topo.outer_group):
            dist.destroy_process_group(g)


def nan_across_ranks(rank: int, world: int) -> dict:
    """float64 (backend auto = reference): a NaN key on the last rank reaches the queries that see it."""
    q, k, v = (x.detach() for x in _qkv(dtype=torch.float64))
    if rank == world - 1:
        k[0, 0, 0, 0] = float("nan")
    out = burstattn.burst_attn_func(q, k, v, layout="contiguous")  # non-causal: every query sees it
    return dict(all_nan_head0=bool(out[..., 0, :].isnan().all()), head1_finite=bool(out[..., 1, :].isfinite().all()))


def layout_none_is_zigzag(rank: int, world: int) -> dict:
    """``layout=None`` against ``layout="zigzag"`` for the sharding functions and every strategy, on
    real data (at world > 1 zigzag is not the identity). Returns, per function or strategy, whether
    the two agree exactly (outputs and q/k/v gradients), and whether zigzag differs from contiguous."""
    from burstattn.strategies import STRATEGIES
    from burstattn.testing.oracle import exact_attention

    seq, heads = 8 * world, 4
    gen = torch.Generator().manual_seed(7)
    full = [torch.randn(1, seq, heads, 16, generator=gen) for _ in range(4)]  # q, k, v, grad_out
    x = full[0]
    out = {"shard": torch.equal(burstattn.shard_sequence(x, layout=None), burstattn.shard_sequence(x, layout="zigzag")),
           "positions": torch.equal(burstattn.sequence_positions(seq, layout=None),
                                    burstattn.sequence_positions(seq, layout="zigzag")),
           "not_identity": not torch.equal(burstattn.shard_sequence(x, layout="zigzag"),
                                           burstattn.shard_sequence(x, layout="contiguous"))}
    local = burstattn.shard_sequence(x, layout="zigzag")
    out["gather"] = torch.equal(burstattn.gather_sequence(local, layout=None), x)
    want, _ = exact_attention(*(t.double() for t in full[:3]), causal=True)
    for name in sorted(STRATEGIES):
        opts = dict(ulysses_degree=2, ring_degree=world // 2) if name == "usp" else {}
        if name == "usp" and world % 2:
            continue
        runs = []
        for layout in (None, "zigzag"):
            q, k, v = (burstattn.shard_sequence(t, layout="zigzag").clone().requires_grad_() for t in full[:3])
            o = burstattn.attention(q, k, v, strategy=name, causal=True, layout=layout, **opts)
            o.backward(burstattn.shard_sequence(full[3], layout="zigzag"))
            runs.append((o.detach(), q.grad, k.grad, v.grad))
        same = all(torch.equal(a, b) for a, b in zip(*runs))
        err = float((burstattn.gather_sequence(runs[0][0], layout="zigzag").double() - want).abs().max())
        out[name] = dict(same=same, error=err)
    if SUBGROUPS.entries:
        for e in list(SUBGROUPS.entries.values()):
            for g in (e.ulysses_group, e.ring_group):
                dist.destroy_process_group(g)
        SUBGROUPS.clear()
    return out

"""One attention call's buffers on a GPU in 16 bits: one kernel call per ring step, block op and head group in
the inputs' dtype (``grad_partials="kernel"``, the GPU's path: no float32 tiles), its partials accumulated in
float32 (pure; bytes per device).

Two parts: the library's own buffers (the engine's copies, travelling blocks, float32 accumulators, the
collectives' buffers of the strategies that gather), in units of one local query shard in the inputs' dtype
(``B x n x Hq x d x e``: :data:`GPU_UNITS`), and what the kernel allocates besides at its largest call
(:func:`kernel_bytes`, from :mod:`burstattn.kernels.workspace`: the same function the dry run adds at each
call). The units were read off the dry run's attention call (``burstattn train --dry-run``'s tracker around
one ``burstattn.attention`` forward and backward on fake bf16 tensors: worlds 2, 4 and 8, heads 4/4, 4/1, 8/8,
8/4, 8/2, 32/8, head_dim 32, 64, 128, 2,048 to 32,768 tokens per rank, so 1 to 8 head groups), fitted within
10% of those peaks (the kernel term taken as it is), bench/results/simulation.md. On a CPU, and for float32, the units
of :data:`burstattn.sim.memory.CALL_UNITS` (measured on this machine) apply.
"""
from __future__ import annotations

from typing import Optional

from .plans import head_groups

ONE_HEAD = 3.0
"""What ulysses and usp hold less with one query head per rank (its head shards are the all-to-all's outputs
as they are): the dry run's call, float32 and bf16, heads 4/4 and 4/1 over 4 ranks, 8/8 over 8: 14.1 query
shards against 17.1 with two heads per rank."""

# Units of one local query shard in the inputs' dtype; ``r`` = kv heads / query heads (after ulysses' repeats),
# ``G`` the engine's head groups, ``P`` the group size.
GPU_GROUP_UNITS = (2.84, 2.16, 6.02, 11.15)
"""burst, ring, distflash backward: ``a + b r`` held whole (output, dQ, dK, dV) + ``(c + d r) / G`` per group."""
GPU_GROUP_FORWARD = (1.5, 6.5)
"""Their forward: ``a + c / G``."""
GPU_UNITS = {
    "allgather": ((-1.0, 8.0, 10.0), (5.56, 0.0, 2.0)),  # a + b r + c P r (the gathered K/V; dK/dV float32)
    "ulysses": ((10.78, 4.24, -5.8), (4.6, 4.6, 0.0)),  # a + b r + c [r < 1] (r after the kv repeats)
    "tp": ((-1.0, 4.0, 4.0, 8.0), None),  # a + b r + P (c + d r): q, k, v gathered whole
}
"""Backward and forward units of the strategies that gather (forward ``None``: a share of the backward)."""
USP_EXTRA = ((2.0, 5.3, -2.0), (0.5, 5.4, -1.0))
"""usp: its inner burst ring's units (heads ``Hq / u`` over ``u n`` rows) plus ``a + b r`` for the all-to-alls,
or ``c`` when the ring is one rank (backward, forward)."""
FORWARD_SHARE = 0.55


def _reps(kv_heads: int, degree: int) -> int:
    import math

    return math.lcm(kv_heads, degree) // kv_heads


def _group(batch: int, rows: int, hq: int, hkv: int, head_dim: int, backward: bool) -> float:
    g = head_groups(batch, rows, hq, hkv, head_dim)
    r = hkv / hq
    if not backward:
        return GPU_GROUP_FORWARD[0] + GPU_GROUP_FORWARD[1] / g
    a, b, c, d = GPU_GROUP_UNITS
    return a + b * r + (c + d * r) / g


def gpu_call_units(strategy: str, *, batch: int, local_seq: int, world: int, q_heads: int, kv_heads: int,
                   head_dim: int, backward: bool, ulysses: int = 1) -> Optional[float]:
    """The library's buffers of one 16-bit attention call on a GPU, in local query shards (``None``: no GPU
    units for ``strategy``; the caller keeps its CPU units)."""
    r = kv_heads / q_heads
    if strategy in ("burst", "ring", "distflash"):
        return _group(batch, local_seq, q_heads, kv_heads, head_dim, backward)
    if strategy == "usp":
        u = max(1, ulysses)
        hkv = kv_heads * _reps(kv_heads, u) // u
        inner = _group(batch, local_seq * u, max(1, q_heads // u), max(1, hkv), head_dim, backward)
        a, b, c = USP_EXTRA[0 if backward else 1]
        r_inner = max(1, hkv) / max(1, q_heads // u)
        return inner + (a + b * r_inner if world > u else c)
    if strategy == "ulysses":
        r = kv_heads * _reps(kv_heads, world) / q_heads
        a, b, c = GPU_UNITS["ulysses"][0 if backward else 1]
        one = ONE_HEAD if backward and q_heads // world == 1 else 0.0  # its head shards as the all-to-all gives them
        return a + b * r + (c if r < 1 else 0.0) - one
    if strategy == "allgather":
        a, b, c = GPU_UNITS["allgather"][0 if backward else 1]
        return a + b * r + c * world * r
    if strategy == "tp":
        a, b, c, d = GPU_UNITS["tp"][0]
        whole = a + b * r + world * (c + d * r)
        return whole if backward else FORWARD_SHARE * whole
    return None


def kernel_bytes(strategy: str, kernel: Optional[str], *, batch: int, local_seq: int, world: int, q_heads: int,
                 kv_heads: int, head_dim: int, e: int, groups: int = 1, ulysses: int = 1) -> float:
    """What the GPU kernel (``kernel``; ``None``: a CPU, 0) allocates beside its outputs at the largest call of
    a multi-rank attention backward, where a 16-bit step is one kernel call per head group and block op in the
    inputs' dtype (no float32 tiles: :func:`burstattn.sim.memory.tile_bytes` is the CPU's): flash-attn 2's buffers
    (:func:`~burstattn.kernels.workspace.kernel_workspace`) and, for ``sdpa``, its copies of the row slices it
    is given. The calls: a head group's whole shard against itself (the diagonal), and for the balanced
    layouts' half blocks, half the queries against all keys and all queries against half the keys (a half
    of a block with more than one head or sequence is a slice SDPA copies: dO, q, O and the LSE, or K and V).
    Ulysses and tp make one call of the sequence or heads they gather (no slices); usp's inner ring and
    allgather run the engine's calls (allgather over all heads at once)."""
    from ..kernels.workspace import kernel_workspace

    if kernel is None:
        return 0.0
    hq, hkv, rows, halves = q_heads // groups, max(1, kv_heads // groups), local_seq, world > 1
    if strategy in ("ulysses", "usp"):
        degree = world if strategy == "ulysses" else max(1, ulysses)
        rows, hq, hkv = local_seq * degree, max(1, q_heads // degree), max(1, kv_heads // degree)
        halves = strategy == "usp" and world > degree
        if strategy == "usp":
            g = head_groups(batch, rows, hq, hkv, head_dim)
            hq, hkv = hq // g, max(1, hkv // g)
    elif strategy.startswith("tp") or strategy == "rsa":
        return 0.0 if strategy == "rsa" else float(kernel_workspace(
            kernel, batch=batch, q_heads=hq, kv_heads=hkv, q_rows=rows, k_rows=rows, head_dim=head_dim,
            element_size=e, backward=True))
    calls = [(rows, rows, 0)]
    if halves:
        half = rows // 2
        q_copy = batch * half * hq * (3 * head_dim * e + 4) if hq > 1 or batch > 1 else 0
        kv_copy = 2 * batch * half * hkv * head_dim * e if hkv > 1 or batch > 1 else 0
        calls += [(half, rows, q_copy), (rows, half, kv_copy)]
    return float(max(kernel_workspace(kernel, batch=batch, q_heads=hq, kv_heads=hkv, q_rows=nq, k_rows=nk,
                                      head_dim=head_dim, element_size=e, backward=True, copied=c)
                     for nq, nk, c in calls))

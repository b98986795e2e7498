"""Per-device memory: parameters, gradients and optimizer state (with or without ZeRO-3 / FSDP),
activations per checkpointing mode, the attention call's buffers and the KV cache (pure).

Training state as ``burstattn.train.job`` stores it (:func:`state_bytes`): with FSDP2's mixed
precision, float32 weights, gradients and two AdamW moments (16 bytes per parameter, the ZeRO
paper's count) sharded over the data-parallel ranks (``dp * cp``: context-parallel ranks hold the
same weights), two 16-bit layers gathered at a time (the one computing and the one prefetched);
without FSDP the weights cast to the run's dtype, and gradients and moments in it. Tensor
parallelism divides the weights by ``tp``.

Activations by checkpointing mode, blockwise chunk and offload, phase by phase (forward, the
loss's backward, a layer's backward, the optimizer step): :mod:`.activations`. The attention
call's own buffers are the library's measured allocations: :data:`CALL_UNITS`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from ..models.config import LlamaConfig
from .gpu_call import ONE_HEAD, gpu_call_units, kernel_bytes
from .plans import head_groups


HEADROOM = 0.10
"""Of the device memory every answer leaves free (``fits``, ``plan``, ``plan --max-seq-len`` and its ``--verify``):
the CUDA caching allocator's rounding and fragmentation (blocks rounded and split; measured 0.5% over the
allocated bytes for llama3-8b on an H200 and 13-29% for small models, bench/results/simulation.md) and the communication
library's own buffers (NCCL's channels, the ring's staging), which neither the dry run nor the model counts.
A stated assumption, the same for every answer."""
HOST_RESERVE = 16 * 2**30
"""Host memory each process keeps for itself, outside what offload may fill: its CUDA context, libraries, data
loader and batch, and its share of the operating system's (a PyTorch training process takes several GiB
resident before any offload). A node's host memory less this reserve per process is shared by its GPUs
(``sim.step.host_capacity``). A stated assumption."""


@dataclass(frozen=True)
class Memory:
    """Bytes per device, by part, and whether the sum fits (device and host memory).

    ``grads`` are the gradients of all parameters; ``peak_grads`` those alive at the peak phase
    (``None``: all of them); ``activations`` and ``attention`` are what the peak phase adds
    (:mod:`.activations`); ``host`` the activations offloaded to host memory."""

    params: float
    grads: float
    optimizer: float
    activations: float
    attention: float
    kv_cache: float
    capacity: float
    host: float = 0.0
    host_capacity: float = float("inf")
    gathered: float = 0.0
    """Of ``params``: what FSDP all-gathers during the step (allocated in it)."""
    host_state: float = 0.0
    """The offloaded optimizer's parameters, gradients and AdamW state (``offload_optimizer``), exact bytes."""
    host_copied: float = 0.0
    """The bytes copied to the host (``host`` is what the pinned allocator holds for them on a GPU)."""
    phase_totals: Optional[dict] = None
    """Training: the bytes of every phase beyond the weights and optimizer state (:mod:`.activations`)."""
    peak_grads: Optional[float] = None
    phase: str = ""
    terms: Optional[dict] = None

    @property
    def peak(self) -> float:
        grads = self.grads if self.peak_grads is None else self.peak_grads
        return self.params + grads + self.optimizer + self.activations + self.attention + self.kv_cache

    @property
    def usable(self) -> float:
        """The device bytes a plan may fill: the capacity less :data:`HEADROOM`."""
        return (1.0 - HEADROOM) * self.capacity

    @property
    def fits(self) -> bool:
        """The peak within :attr:`usable` and the host bytes within the host's share."""
        return self.peak <= self.usable and self.host <= self.host_capacity

    def parts(self) -> dict:
        """The peak by part: weights, optimizer state, KV cache, gradients, attention call and the
        peak phase's activation terms (they sum to :attr:`peak`)."""
        parts = {"weights": self.params, "optimizer state": self.optimizer, "KV cache": self.kv_cache,
                 "gradients": self.grads if self.peak_grads is None else self.peak_grads,
                 "attention call": self.attention}
        for k, v in (self.terms or {"activations": self.activations}).items():
            if k not in ("gradients", "attention call"):
                parts[k] = parts.get(k, 0.0) + v
        return parts

    def binding(self) -> str:
        """The largest part of the peak (``"host memory"`` when the host copies do not fit)."""
        if self.host > self.host_capacity:
            what = "optimizer state" if self.host_state > self.host - self.host_state else "activations"
            return f"host memory (offloaded {what})"
        parts = self.parts()
        return max(parts, key=parts.get)

    def by_term(self) -> dict:
        """The peak in the dry run's categories (``burstattn train --dry-run``): parameters, gradients
        alive at the peak, optimizer state, activations (with the KV cache) and temporaries (the
        attention call's buffers). They sum to :attr:`peak`."""
        return {"parameters": self.params, "gradients": self.grads if self.peak_grads is None else self.peak_grads,
                "optimizer": self.optimizer, "activations": self.activations + self.kv_cache,
                "temporaries": self.attention}

    def to_dict(self) -> dict:
        out = {k: int(getattr(self, k)) for k in ("params", "grads", "optimizer", "activations", "attention",
                                                 "kv_cache", "host", "host_state")}
        if self.phase:
            out["phase"], out["binding"] = self.phase, self.binding()
        return out


def growing(fits: Memory, over: Memory) -> str:
    """What stops a longer sequence: the part of the peak that grew most from ``fits`` (the longest
    that fits) to ``over`` (one step longer, over the capacity). A part that does not grow with the
    sequence (weights, optimizer state) cannot be it unless nothing grows. ``"host memory"`` when
    the host copies stop it."""
    if over.host > over.host_capacity >= fits.host:
        return over.binding()
    a, b = fits.parts(), over.parts()
    grew = {k: v - a.get(k, 0.0) for k, v in b.items()}
    top = max(grew, key=grew.get)
    return top if grew[top] > 0 else over.binding()


# Peak of one attention fwd+bwd beyond its inputs (q, k, v, dO), per strategy: ``(c_q, c_kv, c_gqa)`` in
# units of one local query shard (``n*Hq*d`` elements): ``c_q + c_kv * Hkv/Hq + c_gqa * [Hkv < Hq]``
# (the output, LSE, internal [B, H, n, D] copies, travelling double buffers, float32 accumulators,
# kernel temporaries, the gradients; ``c_gqa``: what grouped K/V heads add or save, e.g. expansions to
# the query heads, or the smaller all-to-all of repeated kv heads). For the strategies on the engine's
# head groups (:data:`GROUP_UNITS`) this is the part held whole (the output, dQ, dK, dV), and
# ``(g_q + g_kv * Hkv/Hq) / G`` is added for what each of the ``G`` head groups holds
# (``engine.run.head_groups``, docs/algorithm.md section 13). Read off the library's allocations
# (``bench.memory.measure_peak``, float32, world 2, causal zigzag, n = 1024 per rank, heads 8/8, 8/4,
# 8/2, d = 32 (G = 1), and n = 4096, 8/8 heads, d = 32, 64, 128 (G = 2, 4, 8), 8/2 and 8/4 heads, d = 128
# (G = 2, 4); the larger rank of two runs, fitted within 6%); allgather, usp, ulysses and tp (behind the
# op ``strategy_fwd`` since its gradients for the saved outputs stopped being materialised as zeros)
# re-measured at 4/4 heads d = 48 n = 768, 8/2 and 8/4 d = 32 n = 1024 (tp: 8/4 d = 64 n = 512), fitted
# within 4%: the deterministic peak, i.e. the
# smallest of six repeats, which is also the most frequent. On gloo a repeat can hold more: the backend's
# worker thread may drop its reference to a collective's input after the call has moved on, so that
# buffer is freed later than the program frees it (seen: up to 8 units over for ulysses at 4/4 heads, 3
# for usp and tp); that depends on thread timing, not on the program, and is left out of the model
# (``tests/dist/test_sim_library.py`` checks the deterministic peak within 10% and bounds the rest by
# the call's collective buffers).
# Ring Self-Attention adds its two n x N float32 score matrices.
CALL_UNITS = {
    "burst": (2.0, 2.2, 0.0), "ring": (2.0, 2.2, 0.0), "distflash": (2.0, 2.2, 0.0),
    "ulysses": (5.0, 11.8, 0.7), "allgather": (2.1, 20.0, 0.0), "usp": (12.1, 8.0, -1.0),
    "tp": (8.1, 11.9, 0.0), "tp-v1": (8.1, 11.9, 0.0), "tp-v3": (8.1, 11.9, 0.0), "rsa": (3.0, 10.0, 0.0),
}
GROUP_UNITS = {"burst": (6.8, 10.0), "ring": (6.8, 10.0), "distflash": (7.45, 6.75)}  # ``(g_q, g_kv)`` per group
GROUP_FORWARD = (1.0, 8.0)  # forward-only peak of the head-grouped strategies: ``1.0 + 8.0 / G`` (section 13)
FORWARD_SHARE = 0.55  # forward-only peak over fwd+bwd peak of the others (no gradients, no backward ring)
# ``head_chunks`` (the call over G groups of heads, one after another): one group's call, plus what stays
# whole across the groups (the earlier groups' outputs and dQ, dK, dV: (2 + 2 Hkv/Hq) (G-1)/G query
# shards) and the concatenations (the output, and the gradients' at the end): CHUNK_CONCAT query shards.
# Read off ``bench.memory.measure_peak`` (tests/dist/cases/strategies.call_peak: float32, world 2, causal
# zigzag, n = 1024 per rank, 8/8 heads, d = 32, G = 2, 4, 8; burst, ring, ulysses, allgather): the rule
# is within +2% .. +10% of the measured peaks for burst and ring, -10% .. +10% for allgather; ulysses
# -16% .. -21%, as its whole call (22.1 measured there against 16.8 modelled: gloo's late frees, see
# CALL_UNITS) (the larger rank; docs/simulation.md, "Head chunks").
CHUNK_CONCAT = 2.3


ALONE = ("burst", "ring", "distflash")  # over one rank: one kernel call (strategies.burst.alone)


def alone_buffers(*, batch: int, local_seq: int, q_heads: int, kv_heads: int, head_dim: int, e: int,
                  backward: bool, kernel: Optional[str] = None) -> float:
    """A ring strategy over one rank (one GPU, or cp = 1 beside tp): one kernel call, forward its output
    and LSE; backward also dQ, dK, dV and, on a GPU (``kernel``: the backend,
    :data:`~burstattn.kernels.workspace.GPU_BACKENDS`), what that kernel allocates besides
    (:func:`~burstattn.kernels.workspace.kernel_workspace`: float32 ``dq_accum`` and ``softmax_d``, the
    expanded dK/dV of grouped K/V heads; the call's ``[B, n, H, D]`` views are read as they are)."""
    from ..kernels.workspace import kernel_workspace

    rows = batch * local_seq
    out_lse = rows * q_heads * (head_dim * e + 4)
    if not backward:
        return out_lse
    ws = 0 if kernel is None else kernel_workspace(kernel, batch=batch, q_heads=q_heads, kv_heads=kv_heads,
                                                   q_rows=local_seq, k_rows=local_seq, head_dim=head_dim,
                                                   element_size=e, backward=True)
    return out_lse + rows * (q_heads + 2 * kv_heads) * head_dim * e + ws


# On a CPU (``grad_partials="float32"``, the CPU flash kernel's 16-bit partials) a 16-bit multi-rank
# backward runs on float32 copies of one square tile at a time (``engine.compute.BlockCalls``: q, dO,
# O and K, V, and the kernel's float32 gradients): TILE_BYTES bytes per tile row and (query + kv) head
# element of the call's head group, the tile's side the kernel call's query rows capped by
# ``kernels.base.chunk_rows`` (32 MiB of float32 per side). Fitted against the dry run's attention call
# (bf16, world 2, zigzag, n = 8,192-32,768, heads 4/1 and 8/2, d = 64: within 2%; MHA 4/4: 16% over).
TILE_BYTES = 12


def tile_bytes(strategy: str, *, batch: int, local_seq: int, world: int, q_heads: int, kv_heads: int,
               head_dim: int, e: int, groups: int = 1, ulysses: int = 1) -> float:
    """The float32 tile copies of a 16-bit attention backward (:data:`TILE_BYTES`; 0 for 32 and 64
    bits). The kernel call's query rows: half the local shard for the ring strategies and allgather
    (zigzag's halves), half of what the all-to-all gathers for ulysses and usp (their heads over its
    degree), the whole sequence for tp (``local_seq``). None over one rank (``world`` 1: tp alone, or one
    GPU: one dense block, ``strategies.burst.alone``). A GPU's path has no tiles
    (``sim.gpu_call.kernel_bytes`` instead; the dry run takes that path, ``train.dryrun.as_on_a_gpu``)."""
    from ..kernels.base import chunk_rows

    if e >= 4 or world == 1:  # one rank (tp, one GPU): one dense block, the GPU kernel's own backward (alone())
        return 0.0
    hq, hkv = q_heads / groups, kv_heads / groups
    rows = local_seq // 2
    if strategy in ("ulysses", "usp"):
        degree = world if strategy == "ulysses" else max(1, ulysses)
        rows, hq, hkv = local_seq * degree // 2, hq / degree, max(1.0, hkv / degree)
    elif strategy.startswith("tp"):
        rows = local_seq
    side = min(rows, chunk_rows(int(batch * hq * head_dim)))
    return TILE_BYTES * batch * side * (hq + hkv) * head_dim


def attention_buffers(strategy: str, *, batch: int, local_seq: int, world: int, q_heads: int, kv_heads: int,
                      head_dim: int, e: int, backward: bool, schedule: str = "ring", bwd_mode: str = "burst",
                      ulysses: int = 1, head_chunks: int = 1, kernel: Optional[str] = None) -> float:
    """Peak bytes one attention call allocates on one device beyond q, k, v and dO (:data:`CALL_UNITS`,
    :data:`GROUP_UNITS` over the library's ``head_groups``; 16-bit inputs with float32 accumulators count
    ``(e + 4) / 2`` bytes per element). ``q_heads`` / ``kv_heads`` are this tp rank's; for ``tp-v1`` /
    ``tp-v3`` (no sequence split) ``local_seq`` is the whole sequence. Raises ``ValueError`` for an
    unknown strategy. ``head_chunks``: the call over that many groups of heads (:data:`CHUNK_CONCAT`).
    ``kernel``: on a GPU, the attention kernel's backend (one kernel call per head group and block op in the
    inputs' dtype, its own buffers: :func:`kernel_bytes`); ``None``: a CPU (16-bit backwards on float32
    tiles: :func:`tile_bytes`)."""
    if head_chunks > 1:
        group = attention_buffers(strategy, batch=batch, local_seq=local_seq, world=world, q_heads=q_heads // head_chunks,
                                  kv_heads=max(1, kv_heads // head_chunks), head_dim=head_dim, e=e, backward=backward,
                                  schedule=schedule, bwd_mode=bwd_mode, ulysses=ulysses, kernel=kernel)
        whole = (2 + 2 * kv_heads / q_heads) if backward else 1.0  # the earlier groups' outputs (and gradients)
        # in the inputs' dtype on a GPU in 16 bits (no float32 partial stays whole); else (e + 4) / 2 per element
        unit = q_heads * batch * local_seq * head_dim * (e if kernel is not None and e < 4 else (e + 4) / 2)
        return group + unit * (whole * (head_chunks - 1) / head_chunks + (CHUNK_CONCAT if backward else 1.0))
    key = "distflash" if (strategy == "burst" and schedule == "distflash") else strategy
    if (world == 1 and key in ALONE) or key in ("tp-v1", "tp-v3"):  # tp-v1/v3: burst over a cp group of one
        return alone_buffers(batch=batch, local_seq=local_seq, q_heads=q_heads, kv_heads=kv_heads,
                             head_dim=head_dim, e=e, backward=backward, kernel=kernel)
    grouped = key in GROUP_UNITS
    groups = head_groups(batch, local_seq, q_heads, kv_heads, head_dim) if grouped else 1
    call = dict(batch=batch, local_seq=local_seq, world=world, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim)
    gpu = None if kernel is None or e >= 4 else gpu_call_units(key, backward=backward, ulysses=ulysses, **call)
    if gpu is not None:  # a GPU in 16 bits: one kernel call per step and head group (sim.gpu_call)
        ws = kernel_bytes(key, kernel, e=e, groups=groups, ulysses=ulysses, **call) if backward else 0.0
        return gpu * batch * local_seq * q_heads * head_dim * e + ws
    if key not in CALL_UNITS:
        raise ValueError(f"no memory model for strategy {strategy!r}; known: {sorted(CALL_UNITS)}")
    cq, ckv, cg = CALL_UNITS[key]
    per_elem = (e + 4) / 2
    ratio = kv_heads / q_heads
    units = cq + ckv * ratio + (cg if kv_heads < q_heads else 0.0)
    if key in ("ulysses", "usp"):
        units = a2a_call_units(key, world=world, q_heads=q_heads, kv_heads=kv_heads, ulysses=ulysses)
    if grouped:
        gq, gkv = GROUP_UNITS[key]
        units = units + (gq + gkv * ratio) / groups if backward else GROUP_FORWARD[0] + GROUP_FORWARD[1] / groups
    total = units * q_heads * batch * local_seq * head_dim * per_elem
    if backward:
        total += tile_bytes(key, e=e, groups=groups, ulysses=ulysses, **call) if kernel is None else \
            kernel_bytes(key, kernel, e=e, groups=groups, ulysses=ulysses, **call)
    if strategy == "rsa":
        total += 2 * batch * q_heads * local_seq * world * local_seq * 4
    return total if (backward or grouped) else FORWARD_SHARE * total


USP_UNITS = (9.05, 8.0, 2.5)
"""usp on a CPU: ``a + b r + c [r < 1 and a ring of more than one rank]`` query shards (``r`` after the kv
repeats), read off the dry run's float32 call (worlds 2 and 4, Ulysses 2 and 4, heads 4/4, 4/2, 4/1)."""


def a2a_call_units(key: str, *, world: int, q_heads: int, kv_heads: int, ulysses: int = 1) -> float:
    """Query shards of one ulysses or usp call on a CPU (or in float32): :data:`CALL_UNITS`' ulysses with the
    kv heads after their repeats (``lcm(Hkv, P) / Hkv``: small-l3's one kv head over 2 ranks is 2, 22% low
    before), :data:`USP_UNITS` for usp (its units were read at one shape; the dry run of ``small`` over 4 ranks
    was 43% over), less :data:`ONE_HEAD` with one query head per rank."""
    degree = world if key == "ulysses" else max(1, ulysses)
    reps = math.lcm(kv_heads, degree) // kv_heads
    r = kv_heads * reps / q_heads
    one = ONE_HEAD if q_heads // degree == 1 else 0.0
    if key == "ulysses":
        cq, ckv, cg = CALL_UNITS["ulysses"]
        return cq + ckv * r + (cg if kv_heads < q_heads else 0.0) - one
    a, b, c = USP_UNITS
    return a + b * r + (c if r < 1 and world > degree else 0.0) - one


def eager_kept_units(strategy: str, *, world: int, q_heads: int, kv_heads: int, head_dim: int, e: int,
                     seq_len: int, ulysses: int = 1) -> float:
    """What an attention that is not the registered op keeps after its forward (its saved tensors
    and output), in units of one query shard (``n x Hq x head_dim x e``), read off the library
    (``bench.memory.measure_peak``'s end bytes, float32, worlds 2 and 4, heads 4/1 d64, 8/8 and 8/2
    d32; in training, small-l3): ``ulysses`` its head-sharded q, k, v (kv heads repeated to
    ``lcm(Hkv, P)``, the unrepeated k, v kept too), output and the returned output; ``usp`` that over its Ulysses degree plus the ring's (conservative);
    ``rsa`` its ``[Hq, n, N]`` float32 scores; ``tp`` its gathered heads (grows with P);
    ``allgather`` its local q, k, v, output and LSE (small-l3, remat: 2.6 measured, 2.53 here; it
    gathers K/V again in its backward). The op strategies keep their output and LSE: 1."""
    import math

    def a2a(degree: int) -> float:  # its q, k, v sent and received (kv repeated), output twice; k, v before
        reps = math.lcm(kv_heads, degree) // kv_heads
        return (q_heads + 2 * kv_heads * reps + (2 * kv_heads if reps > 1 else 0)) / q_heads + 2.0

    if strategy == "ulysses":
        return a2a(world)
    if strategy == "usp":  # its inner ring's head-sharded q, k, v and output, as ulysses' (dry run, small, MHA)
        return a2a(max(1, ulysses))
    if strategy == "rsa":
        return 2.0 + seq_len * 4 / (head_dim * e)
    if strategy == "tp":
        return 1.0 + 4.8 * world
    if strategy == "allgather":  # its q, k, v (local, not the gathered K/V) and output, with the LSE
        return 1.0 + (q_heads + 2 * kv_heads) / q_heads + 4 / (head_dim * e)
    return 1.0


def eager_shared_units(strategy: str, *, q_heads: int, kv_heads: int) -> float:
    """Query shards of :func:`eager_kept_units` that a layer keeps anyway without checkpointing: its
    rotated q, k, v, ``(Hq + 2 Hkv) / Hq``, for allgather and ulysses; 0 for the others. Read off the
    same steps with and without these strategies (small-l3 at 2,048 tokens over 2 ranks, float32, and the
    dry run of llama3-8b at 128K over 8, bf16: allgather's ``none`` step holds what burst's holds,
    ulysses' one query shard more at llama3-8b and 1.5 at small-l3's repeated kv heads, bench/results/simulation.md).
    ``usp`` keeps, as ulysses, its head-sharded copies in their place (the dry run of ``small`` over 4 ranks:
    with 0 here the model held 2.1x the kept activations of the step)."""
    return (q_heads + 2 * kv_heads) / q_heads if strategy in ("allgather", "ulysses", "usp") else 0.0


def replicated_kv_params(model: LlamaConfig, tp: int) -> float:
    """Parameters one tp rank holds beyond ``num_params / tp`` when ``tp`` exceeds the kv heads:
    ``wk`` and ``wv`` whole on every rank (``burstattn.parallel.tp_kv``) instead of a 1/tp column split."""
    if tp <= model.n_kv_heads:
        return 0.0
    return 2 * model.n_layers * model.dim * model.n_kv_heads * model.head_dim * (1 - 1 / tp)


def gathered_bytes(model: LlamaConfig, *, tp: int, e: int) -> float:
    """What FSDP holds all-gathered during a step: two blocks (the one computing and the one
    prefetched) and the root unit (embedding, final norm, output head), unsharded."""
    h = model.dim
    head = model.vocab_size * h * (1 if model.tie_embeddings else 2) / tp + h
    layer = (model.num_params() - model.vocab_size * h * (1 if model.tie_embeddings else 2) - h) / model.n_layers / tp \
        + replicated_kv_params(model, tp) / model.n_layers
    return (2 * layer + head) * e


def state_bytes(model: LlamaConfig, *, tp: int, shards: int, fsdp: bool, train: bool, e: int) -> tuple[float, float, float]:
    """``(params, grads, optimizer)`` bytes on one device (``shards`` = dp * cp ranks), as
    ``burstattn.train.job`` stores them. With FSDP the parameters' float32 shard (the master weights:
    FSDP2's ``MixedPrecisionPolicy`` computes in the 16-bit dtype) plus :func:`gathered_bytes`, the
    float32 gradient shard (``reduce_dtype``) plus two blocks' unsharded gradients, and AdamW's two
    float32 moments: 16 bytes per parameter over the shards. Without FSDP the weights are cast to the
    run's dtype (``cast_parameters``): weights, gradients and both moments in it, ``4 e`` bytes."""
    n = model.num_params() / tp + replicated_kv_params(model, tp)
    if not train:
        return n * e, 0.0, 0.0
    if not fsdp:
        return n * e, n * e, 2 * n * e
    layer = n / model.n_layers
    return 4 * n / shards + gathered_bytes(model, tp=tp, e=e), 4 * n / shards + 2 * layer * e, 8 * n / shards


def kv_cache_bytes(model: LlamaConfig, *, batch: int, tokens: int, tp: int, e: int) -> float:
    """K and V of ``tokens`` local cached tokens, every layer (kv heads split by tp, at least one)."""
    kv_heads = max(1, model.n_kv_heads // tp)
    return 2 * model.n_layers * batch * tokens * kv_heads * model.head_dim * e

"""The simulator's entry point: one training step, prefill or decode step of a whole model.

:func:`simulate` takes a :class:`SimConfig` (model, sequence, strategy and degrees, cluster) and
returns a :class:`SimResult`: time split into compute / exposed communication / idle, peak memory
per device and whether it fits, and the events of a timeline.

``batch`` is the GLOBAL batch, as for ``burstattn train --batch``: sequences per step over all
``dp`` data-parallel replicas (it must divide by ``dp``; each replica takes ``batch / dp``), so two
configurations with the same ``batch`` do the same work and their step times compare directly
(:attr:`SimResult.tokens_per_s`).

Per layer and device (``tokens = (batch / dp) * seq_len / cp`` local tokens, weights divided by ``tp``):

* projections and MLP: ``2 * tokens * (h*(h + 2 kvd) + h*h + 3*h*f) / tp`` FLOPs forward, twice
  that backward, at the cluster's matmul rate; norms, rotary and residuals at memory bandwidth;
* attention: :func:`.attention.attention_timeline` over the cp group (its members ``tp`` apart),
  with this tp rank's heads; one layer's timeline is simulated once and reused for every layer;
* tensor parallelism (Megatron): ``tp-v1`` two all-reduces of the layer's activations forward and
  two backward; ``tp-v3`` (sequence parallel, also used under cp x tp) an all-gather and a
  reduce-scatter in their place; not overlapped;
* checkpointing: ``full`` reruns the layer's forward in the backward, ``remat`` all of it but the
  attention;
* data parallelism over the ``dp * cp`` ranks that share weights: a gradient all-reduce that
  overlaps the backward (what is left sticks out), or, with FSDP, per layer an all-gather of the
  weights forward and backward and a reduce-scatter of the gradients, prefetched under the layer's
  compute.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Optional

import torch

from ..models.config import LlamaConfig, check_chunk
from ..models.offload import check_offload
from . import memory as mem
from .activations import ATTENTION, GRADIENTS, ActivationShape, training_activations
from . import net, plans, recurrent
from . import offload as host_offload
from .attention import AttnShape, Pass, attention_timeline
from .chunks import count as chunk_count
from .hardware import ClusterHW

from .names import CHECKPOINTING, MODES, STRATEGIES


@dataclass(frozen=True)
class SimConfig:
    """What to simulate. Degrees: ``dp * cp * tp`` devices, tp innermost (inside nodes), then cp."""

    model: LlamaConfig
    seq_len: int
    hw: ClusterHW
    strategy: str = "burst"
    mode: str = "train"
    cp: int = 1
    tp: int = 1
    dp: int = 1
    batch: int = 1
    """Sequences per step over all data-parallel replicas (``burstattn train --batch``)."""
    layout: Optional[str] = None
    schedule: str = "ring"
    checkpointing: str = "full"
    fsdp: bool = False
    dtype: torch.dtype = torch.bfloat16
    causal: bool = True
    ulysses_degree: Optional[int] = None
    window: Optional[int] = None
    """A causal sliding window of this many keys (burst only; the masked direct schedule)."""
    mlp_chunk: int = 0
    """Blockwise MLP: tokens per chunk of the local sequence (0: whole)."""
    loss_chunk: int = 0
    """Blockwise loss: tokens per chunk of the fused norm + head + cross-entropy (0: whole logits)."""
    fused_loss: bool = False
    """The fused loss: the chunks' gradients computed in the forward (no recomputed head; keeps the
    head input's gradient and a float32 ``vocab / tp x dim`` weight gradient until the backward)."""
    offload: str = "none"
    """Saved activations in host memory: ``none``, ``inputs`` (layer inputs) or ``all``."""
    offload_optimizer: bool = False
    """With ``fsdp``: parameters, gradients and AdamW state in host memory, the step on the CPU
    (``burstattn train --offload-optimizer``; :mod:`.offload`)."""
    head_chunks: int = 1
    """The attention over this many groups of heads, one after another (``--head-chunks``): the
    call's buffers scale with one group (:func:`burstattn.sim.memory.attention_buffers`)."""
    kernel: str = "sdpa"
    """The GPU attention kernel whose own buffers are counted (``sdpa`` or ``flash_attn``:
    :mod:`burstattn.kernels.workspace`; the dry run's ``--dry-run-kernel``); a CPU spec (``host_is_device``)
    counts the CPU's float32 tiles instead."""

    @property
    def gpus(self) -> int:
        return self.dp * self.cp * self.tp

    @property
    def replica_batch(self) -> int:
        """Sequences per data-parallel replica: ``batch / dp``."""
        return self.batch // self.dp

    @property
    def tokens_per_step(self) -> int:
        """Tokens one step processes over all devices (decode: one new token per sequence)."""
        return self.batch * (1 if self.mode == "decode" else self.seq_len)


@dataclass
class SimResult:
    time_s: float
    compute_s: float
    exposed_comm_s: float
    idle_s: float
    memory: mem.Memory
    breakdown: dict = field(default_factory=dict)
    passes: tuple = ()  # (forward Pass, backward Pass or None) of one layer's attention
    tokens_per_step: int = 0
    """Tokens of the global batch this step processes (:attr:`SimConfig.tokens_per_step`)."""

    @property
    def tokens_per_s(self) -> float:
        """Throughput of the whole run: ``tokens_per_step / time_s`` (0 without a time)."""
        return self.tokens_per_step / self.time_s if self.time_s > 0 else 0.0

    @property
    def layer_events(self) -> list:
        """``(phase, rank, kind, start_s, stop_s)`` of one layer's attention (backward after forward)."""
        if not self.passes:
            return []
        fwd, bwd = self.passes
        events = [("fwd",) + ev for ev in fwd.events]
        if bwd is not None:
            events += [("bwd", r, k, a + fwd.time, b + fwd.time) for r, k, a, b in bwd.events]
        return events

    @property
    def peak_memory_bytes(self) -> int:
        return int(self.memory.peak)

    @property
    def fits(self) -> bool:
        return self.memory.fits

    def to_dict(self) -> dict:
        return {"time_s": self.time_s, "compute_s": self.compute_s, "exposed_comm_s": self.exposed_comm_s,
                "idle_s": self.idle_s, "tokens_per_step": self.tokens_per_step, "tokens_per_s": self.tokens_per_s, "peak_memory_bytes": self.peak_memory_bytes, "fits": self.fits,
                "capacity_bytes": int(self.memory.capacity), "memory": self.memory.to_dict(),
                "breakdown": {k: float(v) for k, v in self.breakdown.items()}}


def check(cfg: SimConfig) -> None:
    """``ValueError`` naming the argument when the configuration cannot run."""
    if cfg.strategy not in STRATEGIES:
        raise ValueError(f"--strategy must be one of {list(STRATEGIES)}, got {cfg.strategy!r}")
    if cfg.mode not in MODES:
        raise ValueError(f"--mode must be one of {list(MODES)}, got {cfg.mode!r}")
    if cfg.checkpointing not in CHECKPOINTING:
        raise ValueError(f"--checkpointing must be one of {list(CHECKPOINTING)}, got {cfg.checkpointing!r}")
    for name in ("cp", "tp", "dp", "batch", "seq_len"):
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive int, got {v!r}")
    if cfg.model.n_heads % cfg.tp:
        raise ValueError(f"--tp ({cfg.tp}) must divide the model's heads ({cfg.model.n_heads})")
    if cfg.strategy in ("tp-v1", "tp-v3") and cfg.cp > 1:
        raise ValueError(f"strategy {cfg.strategy!r} is tensor parallelism only: give --tp/--dp, not --cp {cfg.cp}")
    if cfg.cp > 1 and cfg.seq_len % (2 * cfg.cp):
        raise ValueError(f"--seq-len ({cfg.seq_len}) must be divisible by 2 * cp ({2 * cfg.cp})")
    if cfg.ulysses_degree is not None and cfg.strategy != "usp":
        raise ValueError(f"--ulysses-degree is an option of --strategy usp, not {cfg.strategy!r}")
    if cfg.batch % cfg.dp:
        raise ValueError(f"--batch ({cfg.batch}) must be divisible by --dp ({cfg.dp}): it is the global batch "
                         "(sequences per step over all data-parallel replicas), as for `burstattn train`")
    for name in ("mlp_chunk", "loss_chunk"):
        check_chunk(f"--{name.replace('_', '-')}", getattr(cfg, name))
    check_offload(cfg.offload, "--offload")
    if cfg.offload != "none" and cfg.mode != "train":
        raise ValueError(f"--offload {cfg.offload} applies to training (--mode train), not --mode {cfg.mode}")
    if cfg.offload_optimizer and (cfg.mode != "train" or not cfg.fsdp):
        raise ValueError("--offload-optimizer is FSDP2's CPUOffloadPolicy: it needs --fsdp and --mode train")
    problem = plans.head_chunks_problem(cfg.head_chunks, cfg.model.n_heads // cfg.tp, max(1, cfg.model.n_kv_heads // cfg.tp))
    if problem:
        raise ValueError(f"--head-chunks: {problem}")


@lru_cache(maxsize=4096)
def _attention(strategy: str, shape: AttnShape, hw: ClusterHW, cp: int, stride: int, layout, schedule: str,
               ulysses, window, chunks: int = 1) -> tuple[Pass, Pass, str]:
    if chunks > 1:  # --head-chunks: one call per group of heads, one after another (more, smaller messages)
        group = dataclasses.replace(shape, q_heads=shape.q_heads // chunks, kv_heads=max(1, shape.kv_heads // chunks))
        fwd, bwd, mode = _attention(strategy, group, hw, cp, stride, layout, schedule, ulysses, window)
        return _repeat(fwd, chunks), _repeat(bwd, chunks), mode
    if strategy in ("tp-v1", "tp-v3") or cp == 1:
        name = "burst"  # one rank: the local kernel over the whole sequence
        t = attention_timeline(name, shape, hw, 1)
    else:
        t = attention_timeline(strategy, shape, hw, cp, stride, layout=layout, schedule=schedule,
                               ulysses_degree=ulysses, window=window)
    return t.forward, t.backward, t.backward_mode


def _repeat(p: Pass, times: int) -> Pass:
    out = Pass()
    for _ in range(times):
        out.add(p)
    return out


def simulate(cfg: SimConfig, memory_only: bool = False) -> SimResult:
    """Simulate ``cfg`` (see the module docstring); ``memory_only``: skip the timeline (times 0).
    Raises ``ValueError`` for bad configurations."""
    check(cfg)
    if memory_only:
        return SimResult(0.0, 0.0, 0.0, 0.0, memory_model(cfg), tokens_per_step=cfg.tokens_per_step)
    m, hw = cfg.model, cfg.hw.for_dtype(cfg.dtype == torch.float32)
    e = torch.empty((), dtype=cfg.dtype).element_size()
    tp, cp = cfg.tp, cfg.cp
    h, f, kvd = m.dim, m.ffn_dim, m.n_kv_heads * m.head_dim
    train = cfg.mode == "train"
    sp = cfg.strategy != "tp-v1"
    tp_pl = net.placement(hw, tp, 1)
    shard_pl = net.placement(hw, cfg.dp * cp, tp)
    kv_heads = max(1, m.n_kv_heads // tp)
    layer_w = (h * (h + 2 * kvd) + h * h + 3 * h * f) / tp  # weights of one layer on this device
    if cfg.mode == "decode":
        return _decode(dataclasses.replace(cfg, hw=hw), e, layer_w, kv_heads)
    if cfg.strategy == "usp" and cfg.ulysses_degree is None:
        import math
        cfg = dataclasses.replace(cfg, ulysses_degree=math.gcd(cp, m.n_heads // tp, max(1, hw.devices_per_node // tp)))
    b = cfg.replica_batch
    tokens = b * cfg.seq_len // cp
    shape = AttnShape(b, cfg.seq_len, m.n_heads // tp, kv_heads, m.head_dim, cfg.dtype, cfg.causal)
    fwd, bwd, bmode = _attention(cfg.strategy, shape, hw, cp, tp, cfg.layout, cfg.schedule, cfg.ulysses_degree,
                                 cfg.window, cfg.head_chunks)
    mm_f = 2 * tokens * layer_w / hw.matmul_rate
    elem_f = tokens * 24 * h * e / (tp if sp else 1) / hw.mem_bw
    act = tokens * h * e
    if tp == 1:
        tp_f = 0.0
    elif cfg.strategy == "tp-v1":
        tp_f = 2 * net.all_reduce_time(tp_pl, act)
    else:
        tp_f = 2 * (net.all_gather_time(tp_pl, act / tp) + net.reduce_scatter_time(tp_pl, act / tp))
    layer = {"matmul": mm_f, "elementwise": elem_f, "attention": fwd.compute, "attn_comm": fwd.exposed_comm,
             "attn_idle": fwd.idle, "tp_comm": tp_f}
    if train:
        recompute = {"none": 0.0, "full": 1.0, "remat": 1.0}[cfg.checkpointing]
        attn_again = cfg.checkpointing == "full"
        comp = mm_f * (3 + recompute) + elem_f * (2 + recompute) + fwd.compute * (1 + attn_again) + bwd.compute
        if cfg.mlp_chunk and cfg.checkpointing != "remat":  # the MLP chunks' own recomputation (remat has it)
            comp += 2 * tokens * (3 * h * f + h * h) / tp / hw.matmul_rate
        comm = fwd.exposed_comm * (1 + attn_again) + bwd.exposed_comm + tp_f * (2 + recompute)
        idle = fwd.idle * (1 + attn_again) + bwd.idle
    else:
        comp, comm, idle = mm_f + elem_f + fwd.compute, fwd.exposed_comm + tp_f, fwd.idle
    # data parallelism over the dp * cp ranks sharing weights
    dp_comm = 0.0
    if train and shard_pl.size > 1:
        if cfg.fsdp:
            shard = layer_w * e / shard_pl.size
            per_layer = 2 * net.all_gather_time(shard_pl, shard) + net.reduce_scatter_time(shard_pl, shard)
            dp_comm = m.n_layers * max(0.0, per_layer - (comp + comm))
        else:
            ar = net.all_reduce_time(shard_pl, layer_w * e * m.n_layers)
            dp_comm = max(ar / m.n_layers, ar - m.n_layers * (mm_f * 2 + bwd.compute))
    head_f = 2 * tokens * h * m.vocab_size / tp / hw.matmul_rate
    head = head_f * (4 if cfg.loss_chunk and not cfg.fused_loss else 3) if train else (2 * b * h * m.vocab_size / tp / hw.matmul_rate)
    optimizer = (16 * 2 * m.num_params() / tp / (shard_pl.size if cfg.fsdp else 1) / hw.mem_bw) if train else 0.0
    chunks_s = chunk_overhead(cfg, hw, e) if train else 0.0
    link = (0.0, 0.0)
    if host_state_offloaded(cfg):
        optimizer = host_offload.cpu_step_seconds(m, tp=tp, shards=shard_pl.size, host_adam_bw=hw.host_adam_bw)
        link = host_offload.host_link_bytes(m, tp=tp, shards=shard_pl.size)
    compute = m.n_layers * comp + head + optimizer + chunks_s
    memory = memory_model(cfg, bmode)
    acts_host = memory.host - memory.host_state
    offload_s = offload_exposed(acts_host, hw.host_bw, forward_s=m.n_layers * (mm_f + elem_f + fwd.compute),
                                backward_s=compute - optimizer - m.n_layers * (mm_f + elem_f + fwd.compute),
                                extra=link) if train else 0.0
    state_s = recurrent.passing_seconds(m, batch=b, cp=cp, tp=tp, hw=hw, train=train)  # hybrids' summaries
    exposed = m.n_layers * comm + dp_comm + offload_s + state_s
    idle_s = m.n_layers * idle
    breakdown = {**{f"layer_fwd_{k}_s": v for k, v in layer.items()}, "layer_bwd_attention_s": bwd.compute,
                 "layer_bwd_attn_comm_s": bwd.exposed_comm, "dp_comm_s": dp_comm, "head_s": head,
                 "optimizer_s": optimizer, "offload_exposed_s": offload_s, "chunk_overhead_s": chunks_s,
                 "state_passing_s": state_s}
    return SimResult(compute + exposed + idle_s, compute, exposed, idle_s, memory, breakdown,
                     (fwd, bwd if train else None), cfg.tokens_per_step)


def chunk_overhead(cfg: SimConfig, hw: ClusterHW, e: int) -> float:
    """Seconds the blockwise chunks add over the whole MLP and loss: per chunk beyond the first, its
    fixed cost (:attr:`ClusterHW.chunk_cost_s`: launches, dispatch) and its weights read again from
    memory in the forward, the recomputed forward and the backward (the MLP's ``3 h f / tp``, the
    head's ``vocab h / tp``). A million one-token chunks cost a million times that, not nothing."""
    m, tp = cfg.model, cfg.tp
    rows = cfg.seq_len // cfg.cp // (tp if tp > 1 and cfg.strategy != "tp-v1" else 1)
    extra = lambda chunk: max(0, chunk_count(rows, chunk) - 1)  # noqa: E731
    mlp_w, head_w = 3 * m.dim * m.ffn_dim / tp * e, m.vocab_size * m.dim / tp * e
    per_mlp = hw.chunk_cost_s + 3 * mlp_w / hw.mem_bw
    per_loss = hw.chunk_cost_s + 3 * head_w / hw.mem_bw
    return m.n_layers * extra(cfg.mlp_chunk) * per_mlp + extra(cfg.loss_chunk) * per_loss


def offload_exposed(host_bytes: float, host_bw: float, *, forward_s: float, backward_s: float,
                    extra: tuple = (0.0, 0.0)) -> float:
    """Seconds of host-link traffic that compute does not hide: the copies to host memory run under
    the forward's compute (a side stream), the copies back under the backward's; what a phase's
    compute cannot cover sticks out. ``extra``: more ``(forward, backward)`` bytes on the same link
    (the offloaded optimizer's parameter and gradient shards)."""
    copy = host_bytes / host_bw
    return max(0.0, copy + extra[0] / host_bw - forward_s) + max(0.0, copy + extra[1] / host_bw - backward_s)


def host_capacity(hw: ClusterHW, gpus: int) -> float:
    """Host memory one device may fill: its share of the node's (``host_mem_bytes`` per device), the node's
    memory over the devices the job uses on it when it uses fewer than the node has (a one-GPU job has the
    whole host, as DeepSpeed ALST's one-GPU runs), less each process's own (:data:`~.memory.HOST_RESERVE`)."""
    return hw.host_mem_bytes * hw.devices_per_node / max(1, min(gpus, hw.devices_per_node)) - mem.HOST_RESERVE


def host_state_offloaded(cfg: SimConfig) -> bool:
    """Whether ``--offload-optimizer`` moves the optimizer's state off the device: not where the host
    memory is the device memory (``hw.host_is_device``: a CPU), where it frees nothing and the state
    is counted where it stays, as for ``--offload``."""
    return cfg.offload_optimizer and not cfg.hw.host_is_device


THROUGH_OP = ("burst", "ring", "tp-v1", "tp-v3")  # attention as the registered op: the lean remat keeps its outputs


def memory_model(cfg: SimConfig, bwd_mode: Optional[str] = None) -> mem.Memory:
    """Peak bytes per device of ``cfg`` (:mod:`.memory`, :mod:`.activations`)."""
    m, hw, tp, cp = cfg.model, cfg.hw, cfg.tp, cfg.cp
    e = torch.empty((), dtype=cfg.dtype).element_size()
    h, f, kvd = m.dim, m.ffn_dim, m.n_kv_heads * m.head_dim
    train, sp = cfg.mode == "train", cfg.strategy != "tp-v1"
    kv_heads = max(1, m.n_kv_heads // tp)
    b = cfg.replica_batch
    tokens = b * cfg.seq_len // cp
    if bwd_mode is None:
        bwd_mode = "kv" if cfg.strategy in ("ring", "rsa") else plans.choose_backward(
            batch=b, local_seq=cfg.seq_len // cp, world_size=cp, q_heads=m.n_heads // tp, kv_heads=kv_heads,
            head_dim=m.head_dim, dtype=cfg.dtype)
    params, grads, opt = mem.state_bytes(m, tp=tp, shards=cfg.dp * cp, fsdp=cfg.fsdp, train=train, e=e)
    host_state = 0.0
    offloaded = host_state_offloaded(cfg)
    if offloaded:
        params, grads, opt, host_state = host_offload.offloaded_state(
            m, tp=tp, shards=cfg.dp * cp, e=e, gathered=mem.gathered_bytes(m, tp=tp, e=e))
    if cfg.mode == "decode":
        cache = mem.kv_cache_bytes(m, batch=b, tokens=tokens, tp=tp, e=e)
        return mem.Memory(params, 0.0, 0.0, b * h * 16 * e, 0.0, cache, hw.mem_bytes)
    call = dict(batch=b, local_seq=cfg.seq_len // cp, world=cp, q_heads=m.n_heads // tp, kv_heads=kv_heads,
                head_dim=m.head_dim, e=e, schedule=cfg.schedule, bwd_mode=bwd_mode, head_chunks=cfg.head_chunks,
                ulysses=cfg.ulysses_degree or 1, kernel=None if hw.host_is_device else cfg.kernel)
    if not train:
        acts = tokens * (4 * h + 2 * (h + 2 * kvd) / tp + 3 * f / tp) * e  # one layer's transient activations
        cache = mem.kv_cache_bytes(m, batch=b, tokens=tokens, tp=tp, e=e)
        attn_mem = mem.attention_buffers(cfg.strategy, backward=False, **call)
        return mem.Memory(params, grads, opt, acts, attn_mem, cache, hw.mem_bytes)
    shape = ActivationShape(rows=tokens // tp if (sp and tp > 1) else tokens, attn_rows=tokens, tp=tp, e=e)
    out_lse = tokens * (m.n_heads // tp) * (m.head_dim * e + 4)
    eager = mem.eager_kept_units(cfg.strategy, world=cp, q_heads=m.n_heads // tp, kv_heads=kv_heads, head_dim=m.head_dim,
                                 e=e, seq_len=cfg.seq_len, ulysses=cfg.ulysses_degree or 1)
    # what the call keeps from its forward is counted with the layer's kept tensors; the call's units (read off
    # whole calls) include it: its output and LSE, and the head-sharded copies ulysses and usp save
    saved = out_lse + (max(0.0, eager - 1.0) * tokens * (m.n_heads // tp) * m.head_dim * e
                       if cfg.strategy in ("ulysses", "usp") else 0.0)
    attn_bwd = max(0.0, mem.attention_buffers(cfg.strategy, backward=True, **call) - saved)
    attn_fwd = mem.attention_buffers(cfg.strategy, backward=False, **call)
    acts = training_activations(m, shape, checkpointing=cfg.checkpointing, eager_units=eager,
                                through_op=cfg.strategy in THROUGH_OP, mlp_chunk=cfg.mlp_chunk,
                               loss_chunk=cfg.loss_chunk, attention_fwd=attn_fwd, fused_loss=cfg.fused_loss,
                               eager_shared=mem.eager_shared_units(cfg.strategy, q_heads=m.n_heads // tp, kv_heads=kv_heads),
                               offload="none" if hw.host_is_device else cfg.offload,  # host = device: nothing moves
                               attention_bwd=attn_bwd, grads=0.0 if offloaded else grads,
                               state_passing=recurrent.kept_bytes(m, batch=b, cp=cp, tp=tp),
                               param_fp32=0.0 if offloaded else (4 if cfg.fsdp else e) * m.num_params() / tp / (cfg.dp * cp if cfg.fsdp else 1))
    t = acts.terms
    rest = sum(v for k, v in t.items() if k not in (GRADIENTS, ATTENTION))
    # host memory as a GPU's pinned allocator holds it (power-of-two blocks); the bytes copied beside it
    pinned = acts.host_pinned + (host_offload.pinned_state_bytes(m, tp=tp, shards=cfg.dp * cp) if host_state else 0.0)
    return mem.Memory(params, grads, opt, rest, t.get(ATTENTION, 0.0), 0.0, hw.mem_bytes,
                      host=acts.host + host_state if hw.host_is_device else pinned, host_copied=acts.host + host_state,
                      host_state=host_state,
                      host_capacity=host_capacity(hw, cfg.gpus), peak_grads=t.get(GRADIENTS, 0.0), phase=acts.phase,
                      terms=dict(t), gathered=mem.gathered_bytes(m, tp=tp, e=e) if cfg.fsdp else 0.0,
                      phase_totals=dict(acts.totals))


def _decode(cfg: SimConfig, e: int, layer_w: float, kv_heads: int) -> SimResult:
    """One decoding step over a cache of ``seq_len`` tokens split over cp: every layer reads its
    weights and its cache shard at memory bandwidth; cp ranks merge partial (out, LSE) with an
    all-gather, tp ranks all-reduce the activations twice."""
    m, hw, tp, cp, b = cfg.model, cfg.hw, cfg.tp, cfg.cp, cfg.replica_batch
    cache_tokens = cfg.seq_len // cp
    kv_bytes = 2 * b * cache_tokens * kv_heads * m.head_dim * e
    read = (layer_w * e + kv_bytes) / hw.mem_bw + 2 * hw.kernel_overhead_s * 6
    flops = 2 * b * layer_w + 4 * b * cache_tokens * m.n_heads / tp * m.head_dim
    comp = max(read, flops / hw.matmul_rate)
    comm = 0.0
    if cp > 1:
        comm += net.all_gather_time(net.placement(hw, cp, tp), b * m.n_heads / tp * (m.head_dim + 1) * 4)
    if tp > 1:
        comm += 2 * net.all_reduce_time(net.placement(hw, tp, 1), b * m.dim * e)
    head = m.vocab_size * m.dim / tp * e / hw.mem_bw
    memory = memory_model(cfg)
    compute = m.n_layers * comp + head
    exposed = m.n_layers * comm
    return SimResult(compute + exposed, compute, exposed, 0.0, memory,
                     {"layer_s": comp, "layer_comm_s": comm, "head_s": head}, tokens_per_step=cfg.tokens_per_step)

"""The planner: every feasible strategy and degree choice, ranked by simulated time per token (pure).

``batch`` is the global batch (sequences per step over all replicas), as for ``sim`` and ``burstattn
train``: every configuration of a plan does the same work per step, so the ranking by time per token
(the inverse of ``tokens_per_s``) is the ranking by step time; ``dp`` takes only values that divide
``batch`` (``--batch 1``: no data parallelism, one sequence over all the devices).

:func:`plan` enumerates ``tp`` (a divisor of the GPU count that divides the heads and fits in a
node), ``cp`` (a divisor of what is left; ``dp`` takes the rest), every strategy that can run at
those degrees (burst with each schedule, ring, rsa, ulysses, allgather, usp, and Megatron ``tp-v1`` /
``tp-v3`` at ``cp = 1``), checkpointing ``none | full | remat`` and FSDP on or off (training), with FSDP
the optimizer offloaded to the host or not, and the attention whole or over one group per kv head
(``head_chunks``); a
configuration ``burstattn train`` would refuse (:func:`burstattn.train.checks.check_parallel`: the
model's kv heads, MLP or vocabulary not divisible by ``tp``, a sequence that does not split) is not
offered. Configurations over the memory limit are kept in the ranking, after every one that fits,
with the reason; a configuration that does not fit is never first. :func:`max_seq_len` bisects, per
strategy, the longest sequence that fits with the most memory-frugal options (full checkpointing, FSDP).

Speed: one layer's attention timeline is simulated once per (strategy, degrees, shape) and reused
by every checkpointing / FSDP / dp variant; the memory model alone is used while bisecting.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import torch

from ..models.blockwise import MLP_TILE, auto_chunks
from ..models.config import LlamaConfig
from ..models.offload import OFFLOAD
from .chunks import frugal, search_chunks
from .feasible import Exclusion, degree_problem, exclusions
from .hardware import ClusterHW
from .memory import HEADROOM, growing
from .names import seconds, size
from .step import SimConfig, SimResult, simulate


@dataclass(frozen=True)
class Candidate:
    cfg: SimConfig
    result: SimResult
    label: str

    def degrees(self) -> dict:
        return {"dp": self.cfg.dp, "cp": self.cfg.cp, "tp": self.cfg.tp}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _runs(model: LlamaConfig, seq_len: int, batch: int, strategy: str, opts: dict, dp: int, cp: int,
          tp: int) -> bool:
    """Whether ``burstattn train`` can run this configuration (its own checks, no process group)."""
    return _train_problem(model, seq_len, batch, strategy, opts, dp, cp, tp) is None


def _train_problem(model: LlamaConfig, seq_len: int, batch: int, strategy: str, opts: dict, dp: int, cp: int,
                   tp: int) -> Optional[str]:
    """Why ``burstattn train`` refuses this configuration (its own message), or ``None``."""
    from ..train.checks import TRAIN_SCHEDULES, check_parallel
    from ..train.config import TrainConfig

    schedule = opts.get("schedule", "ring")  # "double": train runs the one-level ring (the plan's note says so)
    try:
        check_parallel(TrainConfig(model="plan", seq_len=seq_len, batch=batch, strategy=strategy, dp=dp, cp=cp, tp=tp,
                                   layout=opts.get("layout"), ulysses_degree=opts.get("ulysses_degree", 0),
                                   schedule=schedule if schedule in TRAIN_SCHEDULES else "ring"), dp * cp * tp, model)
    except ValueError as e:
        return str(e)
    return None


def _options(model: LlamaConfig, gpus: int, hw: ClusterHW, seq_len: int, mode: str, batch: int = 1):
    """Every (strategy, options, cp, tp) that can run with ``dp = gpus / (cp tp)`` dividing ``batch``."""
    for tp in _divisors(gpus):
        if tp > hw.devices_per_node or model.n_heads % tp:
            continue
        heads = model.n_heads // tp
        for cp in _divisors(gpus // tp):
            if degree_problem(model, gpus, hw.devices_per_node, seq_len, batch, cp, tp):  # (feasible.py: why)
                continue
            if cp == 1:
                if tp > 1:
                    yield "tp-v1", {}, cp, tp
                    yield "tp-v3", {}, cp, tp
                else:
                    yield "burst", {}, cp, tp  # data parallel only: local attention
                continue
            yield "burst", {"schedule": "ring", "layout": "zigzag"}, cp, tp
            yield "burst", {"schedule": "distflash", "layout": "contiguous"}, cp, tp
            if cp > max(1, hw.devices_per_node // tp):
                yield "burst", {"schedule": "double", "layout": "zigzag"}, cp, tp
            yield "ring", {}, cp, tp
            yield "allgather", {}, cp, tp
            if heads % cp == 0:
                yield "ulysses", {}, cp, tp
            if cp * tp <= 64 and seq_len // cp <= 32768:
                yield "rsa", {}, cp, tp  # keeps n x N scores: only ever a candidate at small sizes
            u = math.gcd(cp, heads, max(1, hw.devices_per_node // tp))
            if 1 < u < cp:
                yield "usp", {"ulysses_degree": u}, cp, tp


def excluded(model: LlamaConfig, seq_len: int, gpus: int, hw: ClusterHW, mode: str = "train",
             batch: int = 1) -> list[Exclusion]:
    """Per constraint, the configurations :func:`plan` leaves out (:func:`.feasible.exclusions`): the
    degree choices that cannot split, and the strategies ``burstattn train`` refuses."""
    refused = []
    for strategy, opts, cp, tp in _options(model, gpus, hw, seq_len, mode, batch):
        problem = _train_problem(model, seq_len, batch, strategy, opts, gpus // (cp * tp), cp, tp)
        if problem:
            refused.append((_label(strategy, opts), cp, tp, problem))
    return exclusions(model, gpus, hw.devices_per_node, seq_len, batch, refused)


def _label(strategy: str, opts: dict) -> str:
    if strategy == "burst" and opts.get("schedule", "ring") != "ring":
        return f"burst({opts['schedule']})"
    if strategy == "usp":
        return f"usp(ulysses={opts['ulysses_degree']})"
    return strategy


@dataclass(frozen=True)
class MemoryChoice:
    """What the planner may fix instead of searching (``None``: searched)."""

    mlp_chunk: Optional[int] = None
    loss_chunk: Optional[int] = None
    offload: Optional[str] = None
    dtype: torch.dtype = torch.bfloat16
    """The training / inference dtype (not searched): float32 keeps float32 weights and two moments,
    bfloat16 / float16 16-bit compute (float32 master weights with FSDP) (:func:`.memory.state_bytes`)."""
    offload_optimizer: Optional[bool] = None
    """FSDP2's CPUOffloadPolicy (``None``: searched with FSDP, off when ``offload`` is fixed to ``none``)."""
    head_chunks: Optional[int] = None
    """The attention over groups of heads (``None``: 1 and the most groups the kv heads allow, searched)."""
    fused_loss: Optional[bool] = None
    """The fused blockwise loss (``None``: tried with the blockwise chunks, beside the unfused one,
    so that the longest context never shrinks for it)."""


def chunk_pair(model: LlamaConfig, seq_len: int, cp: int, tp: int, strategy: str, blockwise: bool,
               fixed: MemoryChoice) -> tuple[int, int]:
    """``(mlp_chunk, loss_chunk)`` of a candidate: the fixed ones, else whole (``blockwise=False``) or
    the automatic chunks of ``burstattn train`` for the local rows (:func:`burstattn.models.auto_chunks`)."""
    rows = seq_len // cp // (tp if tp > 1 and strategy != "tp-v1" else 1)
    auto = auto_chunks(model.dim, model.vocab_size, max(rows, 1)) if blockwise else (0, 0)
    if blockwise:  # the automatic rule keeps short sequences whole; the planner's blockwise always chunks
        auto = (auto[0] or MLP_TILE, auto[1] or 1024)
    return (auto[0] if fixed.mlp_chunk is None else fixed.mlp_chunk,
            auto[1] if fixed.loss_chunk is None else fixed.loss_chunk)


def memory_choices(mode: str, fixed: MemoryChoice, hw: Optional[ClusterHW] = None) -> list[dict]:
    """The checkpointing / FSDP / blockwise / offload combinations the planner tries (training):
    offload only where a checkpoint keeps little (``full``, ``remat``), and neither activation nor
    optimizer offload where the host memory is the device's (``hw.host_is_device``: a CPU, where it
    frees nothing)."""
    if mode != "train":
        return [dict(checkpointing="none", fsdp=False, blockwise=False, offload="none")]
    blockwise = (False, True) if fixed.mlp_chunk is None or fixed.loss_chunk is None else (True,)
    same_memory = hw is not None and hw.host_is_device
    out = []
    for ck in ("none", "full", "remat"):
        offloads = (fixed.offload,) if fixed.offload is not None else (
            ("none",) if ck == "none" or same_memory else OFFLOAD)
        out += [dict(checkpointing=ck, fsdp=f, blockwise=b, offload=o, offload_optimizer=oo, fused_loss=fu)
                for f in (False, True) for b in blockwise for o in offloads
                for oo in optimizer_offloads(f, fixed, same_memory) for fu in _fused(b, fixed)]
    return out


def optimizer_offloads(fsdp: bool, fixed: MemoryChoice, same_memory: bool = False) -> tuple[bool, ...]:
    """``offload_optimizer`` values tried: only with FSDP; fixed, or off under ``--offload none`` and
    where the host memory is the device's (``same_memory``: it frees nothing there)."""
    if not fsdp:
        return (False,)
    if fixed.offload_optimizer is not None:
        return (fixed.offload_optimizer,)
    return (False,) if fixed.offload == "none" or same_memory else (False, True)


def head_chunk_values(model: LlamaConfig, tp: int, fixed: MemoryChoice) -> tuple[int, ...]:
    """``head_chunks`` tried: the fixed value, else 1 and the kv heads per tp rank (one kv head per group)."""
    if fixed.head_chunks is not None:
        return (fixed.head_chunks,)
    kv = max(1, model.n_kv_heads // tp)
    return (1, kv) if kv > 1 else (1,)


def _fused(blockwise: bool, fixed: MemoryChoice) -> tuple[bool, ...]:
    """The fused-loss settings a candidate tries: the fixed one, else both with the blockwise chunks."""
    if fixed.fused_loss is not None:
        return (fixed.fused_loss,)
    return (False, True) if blockwise else (False,)


def _sim_config(model, seq_len, hw, strategy, opts, cp, tp, gpus, mode, batch, choice: dict,
                fixed: MemoryChoice, chunks: str = "search") -> SimConfig:
    """The candidate's config; blockwise chunks not fixed are searched (``chunks="search"``: the fewest
    that fit, :func:`.chunks.search_chunks`) or the most frugal (``"frugal"``: bisecting a length)."""
    mlp, loss = chunk_pair(model, seq_len, cp, tp, strategy, choice["blockwise"], fixed)
    cfg = SimConfig(model, seq_len, hw, strategy, mode, cp=cp, tp=tp, dp=gpus // (cp * tp), batch=batch,
                    checkpointing=choice["checkpointing"], fsdp=choice["fsdp"], mlp_chunk=mlp, loss_chunk=loss,
                    offload=choice["offload"], dtype=fixed.dtype,
                    offload_optimizer=choice.get("offload_optimizer", False),
                    head_chunks=choice.get("head_chunks", 1), fused_loss=choice.get("fused_loss", False), **opts)
    if not choice["blockwise"] or (fixed.mlp_chunk is not None and fixed.loss_chunk is not None):
        return cfg
    rows = max(1, seq_len // cp // (tp if tp > 1 and strategy != "tp-v1" else 1))
    with_chunks = lambda m, x: dataclasses.replace(cfg, mlp_chunk=m, loss_chunk=x)  # noqa: E731
    pair = None
    if chunks == "search":
        pair = search_chunks(lambda m, x: simulate(with_chunks(m, x), memory_only=True).fits, rows, fixed.mlp_chunk,
                             fixed.loss_chunk)
    return with_chunks(*(pair or frugal(rows, fixed.mlp_chunk, fixed.loss_chunk)))


def _with_chunks(choices: list[dict], model: LlamaConfig, tp: int, strategy: str, opts: dict, cp: int,
                 fixed: MemoryChoice) -> list[dict]:
    """``choices`` times the head chunks of :func:`head_chunk_values` that ``burstattn train`` takes
    (each group's query heads still split over ulysses' cp degree, usp's Ulysses degree)."""
    degree = cp if strategy == "ulysses" else opts.get("ulysses_degree", 1) if strategy == "usp" else 1
    values = [c for c in head_chunk_values(model, tp, fixed) if (model.n_heads // tp // c) % degree == 0]
    return [{**choice, "head_chunks": c} for choice in choices for c in values]


def candidates(model: LlamaConfig, seq_len: int, gpus: int, hw: ClusterHW, mode: str = "train",
               batch: int = 1, fixed: MemoryChoice = MemoryChoice()) -> list[Candidate]:
    """Every configuration, simulated (unsorted)."""
    if gpus < 1:
        raise ValueError(f"--gpus must be a positive int, got {gpus!r}")
    out = []
    choices = memory_choices(mode, fixed, hw)
    for strategy, opts, cp, tp in _options(model, gpus, hw, seq_len, mode, batch):
        if not _runs(model, seq_len, batch, strategy, opts, gpus // (cp * tp), cp, tp):
            continue
        for choice in _with_chunks(choices, model, tp, strategy, opts, cp, fixed):
            cfg = _sim_config(model, seq_len, hw, strategy, opts, cp, tp, gpus, mode, batch, choice, fixed)
            out.append(Candidate(cfg, simulate(cfg), _label(strategy, opts)))
    return out


def _why(c: Candidate, best: Candidate) -> str:
    """Why ``c`` ranks where it does: out of memory, the best, a tie, or the part of the step (exposed
    communication, idle, compute) that grew most against the best."""
    r, b = c.result, best.result
    if not r.fits and r.memory.host > r.memory.host_capacity:
        return f"out of host memory: {size(r.memory.host)} > {size(r.memory.host_capacity)} per device ({r.memory.binding()})"
    if not r.fits:
        return (f"out of memory: {size(r.peak_memory_bytes)} > {size(r.memory.usable)} per device (its "
                f"{size(c.cfg.hw.mem_bytes)} less the {HEADROOM:.0%} headroom)")
    if c is best:
        return "fastest configuration that fits"
    slower = r.time_s / b.time_s - 1
    if slower < 0.01:
        return f"a tie with the best ({slower:+.1%})"
    grew = {"comm": r.exposed_comm_s - b.exposed_comm_s, "idle": r.idle_s - b.idle_s, "compute": r.compute_s - b.compute_s}
    part = max(grew, key=grew.get)
    if part == "comm":
        return f"communication-bound: {r.exposed_comm_s / r.time_s:.0%} of the step is exposed communication " \
               f"({slower:+.0%} vs best)"
    if part == "idle":
        return f"imbalanced: {r.idle_s / r.time_s:.0%} of the step idle ({slower:+.0%} vs best)"
    return f"more compute: {seconds(r.compute_s)} vs {seconds(b.compute_s)} ({slower:+.0%} vs best)"


def plan(model: LlamaConfig, seq_len: int, gpus: int, hw: ClusterHW, mode: str = "train",
         batch: int = 1, model_name: Optional[str] = None, fixed: MemoryChoice = MemoryChoice()) -> list[dict]:
    """The ranking: ``[{"strategy", "degrees", "time_s", "tokens_per_s", "peak_memory_bytes", "fits", "why",
    ...}]``, best first by time per token at the global ``batch`` (configurations that fit before those
    that do not, those by memory). Per strategy label and degrees only the best checkpointing / FSDP /
    blockwise / offload choice is listed."""
    cands = candidates(model, seq_len, gpus, hw, mode, batch, fixed)
    cands.sort(key=lambda c: (not c.result.fits, c.result.time_s / c.cfg.tokens_per_step if c.result.fits
                              else c.result.peak_memory_bytes))
    seen, rows = set(), []
    best = cands[0] if cands and cands[0].result.fits else None
    for c in cands:
        key = (c.label, c.cfg.dp, c.cfg.cp, c.cfg.tp)
        if key in seen:
            continue
        seen.add(key)
        r = c.result
        rows.append({"strategy": c.label, "degrees": c.degrees(), "time_s": r.time_s, "tokens_per_s": r.tokens_per_s,
                     "tokens_per_step": c.cfg.tokens_per_step, "batch": c.cfg.batch, "peak_memory_bytes": r.peak_memory_bytes, "fits": r.fits,
                     "why": _why(c, best) if best is not None else _why(c, c),
                     "checkpointing": c.cfg.checkpointing, "fsdp": c.cfg.fsdp, "mlp_chunk": c.cfg.mlp_chunk,
                     "loss_chunk": c.cfg.loss_chunk, "fused_loss": c.cfg.fused_loss, "offload": c.cfg.offload,
                     "host_memory_bytes": int(r.memory.host),
                     "offload_optimizer": c.cfg.offload_optimizer, "head_chunks": c.cfg.head_chunks,
                     "binding": r.memory.binding(), "peak_by_term": r.memory.by_term(),
                     "capacity_bytes": r.memory.capacity, "compute_s": r.compute_s,
                     "exposed_comm_s": r.exposed_comm_s, "idle_s": r.idle_s, "config": configuration(c.cfg, model_name)})
    return rows


def configuration(cfg: SimConfig, model_name: Optional[str] = None) -> dict:
    """How to run ``cfg`` with this library: ``burstattn.attention(...)`` keywords and, for training
    with a named model, the ``burstattn train`` command (its flags; ``--world-size`` is the GPU count:
    local processes, or under torchrun equal to its WORLD_SIZE)."""
    strategy = {"tp-v1": "tp", "tp-v3": "tp"}.get(cfg.strategy, cfg.strategy)
    kwargs = {"strategy": strategy, "causal": cfg.causal}
    if cfg.layout:
        kwargs["layout"] = cfg.layout
    if cfg.strategy == "burst" and cfg.schedule != "ring":
        kwargs["schedule"] = cfg.schedule
    if cfg.strategy == "usp" and cfg.ulysses_degree:
        kwargs["ulysses_degree"] = cfg.ulysses_degree
        kwargs["ring_degree"] = cfg.cp // cfg.ulysses_degree
    out = {"attention": f"burstattn.attention(q, k, v, group=cp_group, {', '.join(f'{k}={v!r}' for k, v in kwargs.items())})",
           "attention_kwargs": kwargs}
    if cfg.mode != "train" or not model_name:
        return out
    flags = [f"--model {model_name}", f"--seq-len {cfg.seq_len}", f"--batch {cfg.batch}", f"--strategy {cfg.strategy}",
             f"--world-size {cfg.gpus}", f"--dp {cfg.dp}", f"--cp {cfg.cp}", f"--tp {cfg.tp}",
             f"--checkpointing {cfg.checkpointing}", f"--mlp-chunk {cfg.mlp_chunk}", f"--loss-chunk {cfg.loss_chunk}",
             f"--offload {cfg.offload}", f"--dtype {str(cfg.dtype).replace('torch.', '')}"] + \
        (["--fsdp"] if cfg.fsdp else []) \
        + (["--offload-optimizer"] if cfg.offload_optimizer else []) \
        + ([f"--head-chunks {cfg.head_chunks}"] if cfg.head_chunks > 1 else []) \
        + (["--fused-loss"] if cfg.fused_loss else [])
    if cfg.layout:
        flags.append(f"--layout {cfg.layout}")
    if cfg.strategy == "burst" and cfg.schedule == "distflash":
        flags.append("--schedule distflash")
    if cfg.strategy == "usp" and cfg.ulysses_degree:
        flags.append(f"--ulysses-degree {cfg.ulysses_degree}")
    out["train"] = "burstattn train " + " ".join(flags)
    if cfg.strategy == "burst" and cfg.schedule == "double":
        out["note"] = ("schedule='double' (the two-level ring) needs the node topology: `burstattn train` runs the "
                       "one-level ring in its place; burstattn.attention(..., schedule='double', topology=...) runs it")
    return out


def max_seq_len(model: LlamaConfig, gpus: int, hw: ClusterHW, mode: str = "train", batch: int = 1,
                granularity: int = 1024, limit: int = 1 << 27, fixed: MemoryChoice = MemoryChoice(),
                labels: Optional[tuple[str, ...]] = None) -> dict[str, dict]:
    """Per strategy label: the longest sequence (a multiple of ``granularity``) that fits on some
    degree and memory choice (training: checkpointing ``full`` / ``remat`` with FSDP, whole or
    blockwise, each offload allowed by ``fixed``): ``{label: {"tokens", "degrees", "options",
    "binding", "peak_memory_bytes", "host_memory_bytes"}}``, the binding memory term at the longest
    fit. ``labels``: only these strategy labels (default: all)."""
    best: dict[str, dict] = {}
    seen = set()
    if mode == "train":
        choices = [c for c in memory_choices(mode, fixed, hw) if c["fsdp"] and c["checkpointing"] != "none"]
    else:
        choices = memory_choices(mode, fixed, hw)
    probe = 2 * granularity * gpus
    for strategy, opts, cp, tp in _options(model, gpus, hw, probe, mode, batch):
        label = _label(strategy, opts)
        if (label, cp, tp) in seen or (labels is not None and label not in labels) or \
                not _runs(model, probe, batch, strategy, opts, gpus // (cp * tp), cp, tp):
            continue
        seen.add((label, cp, tp))
        step = granularity * (2 * cp // _gcd(2 * cp, granularity) if cp > 1 else 1)
        for choice in _with_chunks(choices, model, tp, strategy, opts, cp, fixed):
            def sim(n: int, chunks: str = "frugal"):
                cfg = _sim_config(model, n, hw, strategy, opts, cp, tp, gpus, mode, batch, choice, fixed, chunks)
                return cfg, simulate(cfg, memory_only=True)

            def fits(n: int) -> bool:
                return sim(n)[1].fits

            lo, hi = 0, step
            while hi <= limit and fits(hi):
                lo, hi = hi, hi * 2
            hi = min(hi, limit + step)
            while hi - lo > step:
                mid = (lo + hi) // 2 // step * step
                if mid <= lo:
                    break
                lo, hi = (mid, hi) if fits(mid) else (lo, mid)
            if lo > best.get(label, {}).get("tokens", -1):
                cfg, res = sim(max(lo, step), "search")  # the fewest chunks that fit at the longest
                over = sim(lo + step)[1].memory  # what stops it one step further: the term that grew
                binding = growing(sim(lo)[1].memory, over) if lo else over.binding()
                best[label] = {"tokens": lo, "degrees": {"dp": gpus // (cp * tp), "cp": cp, "tp": tp},
                               "options": {"checkpointing": cfg.checkpointing, "fsdp": cfg.fsdp, "mlp_chunk": cfg.mlp_chunk,
                                           "loss_chunk": cfg.loss_chunk, "offload": cfg.offload,
                                           "offload_optimizer": cfg.offload_optimizer, "head_chunks": cfg.head_chunks,
                                           "fused_loss": cfg.fused_loss},
                               "binding": binding, "peak_memory_bytes": int(res.memory.peak),
                               "host_memory_bytes": int(res.memory.host)}
    return best


def _gcd(a: int, b: int) -> int:
    return math.gcd(a, b)

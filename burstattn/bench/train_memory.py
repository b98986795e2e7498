"""Memory of real training steps, per rank: one step's allocator peak and resident set, and the floor.

Rank-side pieces shared by ``burstattn bench train --max-len`` (:mod:`.train_maxlen`) and the
tests that validate the simulator's memory model:

* :func:`probe_step`: build the job, create the optimizer state (so that the measured step is a
  steady-state one), run one step under the allocator-event meter (:func:`.memory.measure_peak`)
  and read the resident-set high-water mark (``ru_maxrss``, meaningful in a fresh process).
* :func:`attention_call_peak`: the model's attention alone, fwd+bwd, as ``bench grid`` measures
  it (q, k, v and dO allocated before the call: its output, LSE, buffers and gradients).
* :data:`VARIANTS`: ``"remat-qkv"`` runs ``remat`` with the attention outside the checkpoint,
  keeping q, k, v beside the output: the remat before the lean one, for side-by-side comparison.
"""
from __future__ import annotations

import resource
import time
from typing import Optional

import torch

from ..train.dryrun import warm_optimizer  # the same steady state as the dry run

VARIANTS = ("lean", "remat-qkv")


class KeepQKV:
    """An attention callable without ``through_op``: ``remat`` then keeps what the attention's
    own backward saves (q, k, v, output, LSE), as the remat before the lean one did."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __call__(self, q, k, v):
        return self.inner(q, k, v)


def build(cfg, variant: str = "lean"):
    """The job of ``cfg`` with ``variant`` (:data:`VARIANTS`) applied."""
    from ..train import build_job

    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    job = build_job(cfg)
    if variant == "remat-qkv":
        job.model.attn = KeepQKV(job.model.attn)
    return job


def probe_step(rank: int, world: int, cfg, variant: str = "lean", step: int = 1, copy_offload: bool = False,
               repeats: int = 1) -> dict:
    """One steady-state step of ``cfg`` on this rank: ``{"peak_bytes", "end_bytes", "maxrss_bytes",
    "seconds", "loss", "param_bytes", "local_tokens", "host_bytes"}`` (``param_bytes``: this rank's
    parameter bytes, the size of its gradients; ``copy_offload``: the offload copies on CPU too, so
    ``host_bytes`` counts what would go to host memory). ``repeats > 1`` runs that many steps and keeps
    the one of the smallest peak: the program's own peak, which repeats, without the collective
    buffers gloo's worker thread sometimes frees late (which do not)."""
    from ..train import train_step
    from .memory import measure_peak

    job = build(cfg, variant)
    job.model.offload_copies_on_cpu = copy_offload
    warm_optimizer(job)
    best = None
    for i in range(repeats):
        t0 = time.perf_counter()
        result, peak = measure_peak(lambda: train_step(job, step + i), device=job.device)
        if best is None or peak.peak_bytes < best[1].peak_bytes:
            best = (result, peak, time.perf_counter() - t0)
    result, peak, seconds = best
    param_bytes = sum(_local(p).numel() * _local(p).element_size() for p in job.model.parameters())
    return dict(peak_bytes=peak.peak_bytes, end_bytes=peak.end_bytes, seconds=seconds, loss=result.loss,
                maxrss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, param_bytes=param_bytes,
                local_tokens=int(job.positions.numel()) * (cfg.batch // job.dims.dp), host_bytes=result.host_bytes,
                chunks=[job.model.config.mlp_chunk, job.model.config.loss_chunk])


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def attention_call_peak(rank: int, world: int, cfg, seed: int = 0) -> dict:
    """Peak bytes of the model's attention alone (fwd+bwd) at ``cfg``'s local shape, as ``bench grid``
    measures a call: q, k, v and dO allocated before it. ``{"peak_bytes", "local_tokens"}``."""
    from ..models import preset
    from ..train import build_job
    from .memory import measure_peak

    job = build_job(cfg)
    m = preset(cfg.model)
    n, b = int(job.positions.numel()), cfg.batch // job.dims.dp
    dt = job.model.tok_embeddings.weight.dtype if not hasattr(job.model.tok_embeddings.weight, "to_local") else \
        job.model.tok_embeddings.weight.to_local().dtype
    gen = torch.Generator().manual_seed(seed + rank)
    hq, hkv = m.n_heads // job.dims.tp, max(1, m.n_kv_heads // job.dims.tp)
    q = torch.randn(b, n, hq, m.head_dim, generator=gen).to(dt).requires_grad_()
    k, v = (torch.randn(b, n, hkv, m.head_dim, generator=gen).to(dt).requires_grad_() for _ in "kv")
    do = torch.randn(b, n, hq, m.head_dim, generator=gen).to(dt)
    job.attn(q, k, v).backward(do)  # warm-up (lazy communicators, plans)
    q.grad = k.grad = v.grad = None
    _, peak = measure_peak(lambda: job.attn(q, k, v).backward(do))
    return dict(peak_bytes=peak.peak_bytes, local_tokens=n * b)


def floor_bytes(model_name: str, local_tokens: int, element_size: int = 4, tp: int = 1,
                checkpointing: str = "remat") -> float:
    """The saved tensors of a checkpointing mode: ``remat`` (the lean one) ``layers x (layer input +
    attention output + LSE)``; ``full`` the layer inputs alone (it holds less than remat's floor).
    Raises ``ValueError`` for another mode (``none`` keeps every intermediate: no floor of its own)."""
    from ..models import preset

    m = preset(model_name)
    if checkpointing not in ("remat", "full"):
        raise ValueError(f"floor_bytes: checkpointing must be 'remat' or 'full', got {checkpointing!r}")
    attention = m.n_heads // tp * (m.head_dim * element_size + 4) if checkpointing == "remat" else 0
    return float(m.n_layers * (m.dim * element_size + attention) * local_tokens)


def sim_config(cfg, world: int, hw=None):
    """The simulator's :class:`~burstattn.sim.step.SimConfig` of the training config ``cfg`` at
    ``world`` ranks (its degrees resolved as ``burstattn train`` resolves them; chunks ``None``
    resolved as the job does; ``hw`` default: the ``h100-nvlink-ib`` preset, whose figures do not
    enter the memory model beyond its capacity)."""
    import torch

    from ..models import preset
    from ..parallel import TP_STRATEGIES, resolve_dims
    from ..sim.hardware import preset as hw_preset
    from ..sim.step import SimConfig
    from ..train.checks import check_config, model_config
    from ..train.job import with_chunks

    dims = resolve_dims(world, cfg.strategy, cfg.dp, cfg.cp, cfg.tp)
    ulysses = cfg.ulysses_degree or (check_config(cfg, world, "cpu").ulysses if cfg.strategy == "usp" else None)
    variant = cfg.strategy[3:] if cfg.strategy in TP_STRATEGIES else cfg.tp_variant
    mcfg = with_chunks(model_config(cfg), cfg, dims, variant)
    return SimConfig(model_config(cfg), cfg.seq_len, hw or hw_preset("h100-nvlink-ib"), cfg.strategy, "train", cp=dims.cp,
                     tp=dims.tp, dp=dims.dp, batch=cfg.batch, checkpointing=cfg.checkpointing, fsdp=cfg.fsdp,
                     dtype=getattr(torch, cfg.dtype), mlp_chunk=mcfg.mlp_chunk, loss_chunk=mcfg.loss_chunk,
                     offload=cfg.offload, fused_loss=cfg.fused_loss, offload_optimizer=cfg.offload_optimizer,
                     head_chunks=cfg.head_chunks, schedule=cfg.schedule, ulysses_degree=ulysses)


def fresh_probe(world: int, cfg, variant: str = "lean", threads: int = 1,
                timeout_s: float = 3600.0) -> tuple[Optional[list[dict]], Optional[str]]:
    """:func:`probe_step` in a fresh local group (so ``ru_maxrss`` is this step's): ``(every rank's
    record, None)``, or ``(None, why)`` when the step failed on some rank (``why`` starts with
    ``refused:`` for a configuration the library rejects, e.g. tp over more ranks than kv heads)."""
    from ..testing.launch import LocalGroupError, run_local

    try:
        return run_local(probe_step, world, cfg, variant, threads_per_rank=threads, timeout_s=timeout_s), None
    except LocalGroupError as exc:
        first = exc.errors[min(exc.errors)] if exc.errors else None
        if first is not None and "ValueError" in first.type_names:
            return None, "refused: " + first.message.splitlines()[-1][:300]
        return None, exc.summary[:300]

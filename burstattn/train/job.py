"""Building a training job inside an initialised process group: mesh, model, plans, optimizer.

Order (torchtitan's): the full model is built on every rank from ``seed`` (the same initial
weights whatever the layout), then tensor-parallelized over ``tp``, then FSDP-sharded over
``dp x cp``. Context parallelism needs no wrapping: the model's attention callable runs the
strategy over the ``cp`` group, and the data is cut with :func:`burstattn.parallel.shard_positions`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..comm.agree import agree
from ..config import IGNORE_INDEX, torch_dtype
from ..models import AttnCall, auto_chunks
from ..models.hybrid import model_class
from ..models.offload import offload_problem, offloaded_bytes, optimizer_offload_problem
from ..parallel import (ParallelDims, apply_fsdp, apply_tp, build_mesh, cp_attention, flat_mesh,
                        mixed_precision, shard_positions, shift_labels, build_usp_mesh)
from .checks import check_config, model_config
from .config import TrainConfig
from .data import make_data
from .dispatch_step import Dispatcher, build_dispatcher, uses_dispatch
from .signature import HINT, run_signature



@dataclass
class Job:
    """Everything a step needs. ``positions [N / cp]``: the global positions this rank holds;
    ``rows``: its data-parallel slice of the global batch; ``replicas``: the ``dp x cp`` group over
    which losses (and, without FSDP, gradients) are summed."""

    cfg: TrainConfig
    dims: ParallelDims
    mesh: DeviceMesh
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    attn: AttnCall
    positions: torch.Tensor
    rows: slice
    replicas: dist.ProcessGroup
    data: object
    device: torch.device
    attn_strategy: str
    tp_variant: str
    layout: str
    dispatcher: Optional[Dispatcher] = None
    """Documents / ``--dispatch dynamic``: the per-step placement of sequences on groups of ranks."""

    @property
    def rank(self) -> int:
        return dist.get_rank()


def lr_lambda(cfg: TrainConfig):
    """Linear warm-up over ``cfg.warmup`` steps, then cosine to ``cfg.min_lr_ratio`` at ``cfg.steps``."""
    def factor(step: int) -> float:
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        progress = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def local_rows(cfg: TrainConfig, dims: ParallelDims, variant: str) -> int:
    """Rows of the residual stream one rank holds per sequence: ``seq_len / cp``, and ``/ tp`` with
    Megatron-V3's sequence parallelism."""
    rows = cfg.seq_len // dims.cp
    return rows // dims.tp if dims.tp > 1 and variant == "v3" else rows


def with_chunks(mcfg, cfg: TrainConfig, dims: ParallelDims, variant: str):
    """``mcfg`` with the run's blockwise chunks (``None`` resolved by :func:`~burstattn.models.auto_chunks`)."""
    auto_mlp, auto_loss = auto_chunks(mcfg.dim, mcfg.vocab_size, local_rows(cfg, dims, variant))
    return mcfg.with_overrides(mlp_chunk=auto_mlp if cfg.mlp_chunk is None else cfg.mlp_chunk,
                               loss_chunk=auto_loss if cfg.loss_chunk is None else cfg.loss_chunk,
                               fused_loss=cfg.fused_loss)


def check_host_memory(cfg: TrainConfig, dims: ParallelDims, variant: str, mcfg, device: torch.device) -> None:
    """``--offload`` / ``--offload-optimizer`` on a GPU: raise ``ValueError`` on every rank, naming the
    flag, when the host memory this host's ranks would hold exceeds what is available (the smallest
    share over the ranks decides)."""
    if (cfg.offload == "none" and not cfg.offload_optimizer) or device.type != "cuda":
        return  # on CPU the saved tensors are in host memory already: offload copies nothing
    import socket

    hosts = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    share = torch.tensor([available_host_bytes() / hosts.count(socket.gethostname())], dtype=torch.float64,
                         device=device)
    dist.all_reduce(share, op=dist.ReduceOp.MIN)
    rows = local_rows(cfg, dims, variant)
    need = offloaded_bytes(mcfg, batch=cfg.batch // dims.dp, rows=rows, attn_rows=cfg.seq_len // dims.cp,
                           heads=mcfg.n_heads // dims.tp, checkpointing=cfg.checkpointing, mode=cfg.offload,
                           element_size=torch_dtype(cfg.dtype).itemsize)
    need = 0.0 if cfg.offload == "none" else need
    problem = offload_problem(cfg.offload, need, float(share))
    if problem is None and cfg.offload_optimizer:  # float32 shard, gradients, exp_avg, exp_avg_sq
        state = 16 * mcfg.num_params() / dims.tp / (dims.dp * dims.cp)
        problem = optimizer_offload_problem(state, need, float(share))
    agree("", (), dist.group.WORLD, problem=problem or None)


def available_host_bytes() -> float:
    """``MemAvailable`` of ``/proc/meminfo`` (Linux), else infinity."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float("inf")


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """``model.to(dtype)`` for its floating-point parameters (new ``Parameter`` objects, as
    ``torch.__future__.set_overwrite_module_params_on_conversion`` makes them): also for a model of
    fake tensors (the dry run), whose parameters ``Module.to`` cannot swap in place."""
    new: dict[int, nn.Parameter] = {}  # tied weights stay tied
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if p.is_floating_point():
                if id(p) not in new:
                    new[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
                module._parameters[name] = new[id(p)]


def _device_type() -> str:
    return "cuda" if dist.is_initialized() and dist.get_backend() == "nccl" else "cpu"


def adamw_impl(model: nn.Module, device_type: str, on_host: bool) -> dict:
    """AdamW's implementation flags for parameters on ``device_type``: on a GPU the fused kernel where
    every parameter is a DTensor or none is; else (a mix: tensor parallelism without FSDP, which the
    fused and multi-tensor kernels refuse; the host, CPU or ``--offload-optimizer``) PyTorch's default."""
    if device_type != "cuda" or on_host:
        return {}
    dtensors = [hasattr(p, "to_local") for p in model.parameters()]
    return {"fused": True} if all(dtensors) or not any(dtensors) else {}


def agreed_plan(cfg: TrainConfig, device_type: str):
    """``(plan, model config)`` of ``cfg`` on this rank, once every rank of the default group agrees: the
    checks of :func:`~burstattn.train.checks.check_config` here, then ONE cross-rank comparison of the
    run's signature (:mod:`burstattn.train.signature`). A bad flag on any rank, or ranks launched with
    different settings, raise ``ValueError`` on every rank before any other collective."""
    plan = mcfg = None
    signature, problem = (), None
    try:
        plan = check_config(cfg, dist.get_world_size(), device_type)
        mcfg = with_chunks(model_config(cfg), cfg, plan.dims, plan.variant)
        signature = run_signature(cfg, plan, mcfg)
    except (ValueError, OSError) as exc:  # OSError: a data file this rank cannot read
        problem = (ValueError, str(exc))
    agree("", signature, dist.group.WORLD, problem=problem, hint=HINT)
    return plan, mcfg


def build_job(cfg: TrainConfig, *, optimizer_device: Optional[str] = None) -> Job:
    """The job of ``cfg`` on this rank (every rank of the default group must call it).

    AdamW is PyTorch's fused kernel where the parameters live on a GPU (torchtitan's default: no
    temporaries of the optimizer state's size, which the multi-tensor default allocates; see
    :func:`adamw_impl`), else the default. ``optimizer_device`` ("cuda" or "cpu") chooses for another device than this job's: the dry
    run, on fake CPU tensors, builds the GPU's (and checks the configuration for it: ``--dtype float16``).

    Raises:
        ValueError: on every rank, for degrees, layouts, batch or model shapes that do not fit
            (:func:`~burstattn.train.checks.check_config`), or ranks whose settings differ
            (:func:`agreed_plan`; a :class:`burstattn.comm.agree.Disagreement`).
    """
    if not dist.is_initialized():
        raise ValueError("build_job: torch.distributed is not initialized (use burstattn.testing.launch or torchrun)")
    device_type = _device_type()
    plan, mcfg = agreed_plan(cfg, optimizer_device or device_type)
    dims, attn_strategy, variant, layout, ulysses = plan.dims, plan.strategy, plan.variant, plan.layout, plan.ulysses
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    mesh = build_mesh(dims, device_type)
    check_host_memory(cfg, dims, variant, mcfg, device)
    d, c, _ = dims.coords(dist.get_rank())
    grid = build_usp_mesh(dims, ulysses, device_type)["ring", "ulysses"] if attn_strategy == "usp" else None
    options = {"schedule": cfg.schedule} if cfg.schedule != "ring" else None
    attn = cp_attention(attn_strategy, mesh.get_group("cp"), layout, backend=cfg.backend, usp_grid=grid,
                        options=options, head_chunks=cfg.head_chunks)
    positions = torch.arange(cfg.seq_len) if uses_dispatch(cfg) else (  # dispatch cuts each sequence itself
        shard_positions(cfg.seq_len, strategy=attn_strategy, layout=layout, cp_rank=c, cp_size=dims.cp,
                        ulysses_degree=ulysses))
    torch.manual_seed(cfg.seed)
    model = model_class(mcfg)(mcfg, attn=attn, checkpointing=cfg.checkpointing, offload=cfg.offload)
    if device.type != "cpu":  # built on CPU (the same initial weights on any device), then moved
        model.to(device)
    if dims.tp > 1:
        apply_tp(model, mesh["tp"], variant)
    dtype = torch_dtype(cfg.dtype)
    replica_mesh = flat_mesh(mesh, ("dp", "cp"))
    if cfg.fsdp:
        apply_fsdp(model, replica_mesh, zero=cfg.zero, mp_policy=mixed_precision(dtype), offload=cfg.offload_optimizer)
    elif dtype != torch.float32:
        cast_parameters(model, dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), eps=cfg.adam_eps,
                                  weight_decay=cfg.weight_decay,
                                  **adamw_impl(model, optimizer_device or device.type, cfg.offload_optimizer))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    b = cfg.batch // dims.dp
    docs = cfg.doc_lengths or cfg.eod_id is not None or cfg.doc_offsets
    data = None if docs else make_data(cfg.data, cfg.data_format, cfg.seed, cfg.batch, cfg.seq_len)
    dispatcher = (build_dispatcher(cfg, mcfg, dims.cp, attn_strategy, layout, options, dist.group.WORLD)
                  if uses_dispatch(cfg) else None)
    return Job(cfg, dims, mesh, model, optimizer, scheduler, attn, positions.to(device), slice(d * b, (d + 1) * b),
               replica_mesh.get_group(), data, device, attn_strategy, variant, layout, dispatcher)


def local_batch(job: Job, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """This rank's ``tokens [B/dp, N/cp]``, ``labels`` (shifted on the global sequence; ``IGNORE_INDEX``
    outside the answer with ``targets="answer"``), ``answer`` mask, and the number of targets of the
    global batch."""
    batch = job.data.batch(step)
    labels = shift_labels(batch.tokens)
    if job.cfg.targets == "answer":
        labels = labels.masked_fill(~batch.answer, IGNORE_INDEX)
    pos = job.positions.cpu()
    rows = job.rows

    def cut(x: torch.Tensor) -> torch.Tensor:
        return x[rows].index_select(1, pos).to(job.device)

    total = int((labels != IGNORE_INDEX).sum())
    return cut(batch.tokens), cut(labels), cut(batch.answer), total

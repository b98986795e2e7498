"""The simulator's config of a training config: what ``burstattn plan --verify`` and the dry run's
figures compare with the job ``burstattn train`` builds."""
from __future__ import annotations

import torch

from ..parallel import TP_STRATEGIES, resolve_dims
from ..train.checks import check_config, model_config
from ..train.job import with_chunks
from .hardware import preset as hw_preset
from .step import SimConfig


def sim_config(cfg, world: int, hw=None):
    """The simulator's :class:`~burstattn.sim.step.SimConfig` of the training config ``cfg`` at
    ``world`` ranks (its degrees resolved as ``burstattn train`` resolves them; chunks ``None``
    resolved as the job does; ``hw`` default: the ``h100-nvlink-ib`` preset, whose figures do not
    enter the memory model beyond its capacity)."""
    dims = resolve_dims(world, cfg.strategy, cfg.dp, cfg.cp, cfg.tp)
    ulysses = cfg.ulysses_degree or (check_config(cfg, world, "cpu").ulysses if cfg.strategy == "usp" else None)
    variant = cfg.strategy[3:] if cfg.strategy in TP_STRATEGIES else cfg.tp_variant
    mcfg = with_chunks(model_config(cfg), cfg, dims, variant)
    return SimConfig(model_config(cfg), cfg.seq_len, hw or hw_preset("h100-nvlink-ib"), cfg.strategy, "train", cp=dims.cp,
                     tp=dims.tp, dp=dims.dp, batch=cfg.batch, checkpointing=cfg.checkpointing, fsdp=cfg.fsdp,
                     dtype=getattr(torch, cfg.dtype), mlp_chunk=mcfg.mlp_chunk, loss_chunk=mcfg.loss_chunk,
                     offload=cfg.offload, fused_loss=cfg.fused_loss, offload_optimizer=cfg.offload_optimizer,
                     head_chunks=cfg.head_chunks, schedule=cfg.schedule, ulysses_degree=ulysses)

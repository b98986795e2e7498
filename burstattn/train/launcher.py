"""Starting a training run: under ``torchrun`` (its environment is detected) or on
``world_size`` local processes (gloo on CPU, NCCL when there is a GPU per process)."""
from __future__ import annotations

import datetime
import os
from typing import Mapping, Optional

import torch
import torch.distributed as dist

from ..testing.launch import run_local
from .checks import check_config
from .config import TrainConfig
from .loop import train

RUN_FOREVER_S = 30 * 24 * 3600.0  # the local launcher's overall limit: the collectives have their own


def torchrun_env(environ: Mapping[str, str]) -> bool:
    """Whether ``environ`` is a torchrun (torch.distributed.elastic) worker's environment."""
    return all(k in environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"))


def _rank_main(rank: int, world: int, cfg: TrainConfig, progress: bool) -> list[dict]:
    return train(cfg, progress=progress)


def run_torchrun(cfg: TrainConfig, progress: bool = True) -> list[dict]:
    """Join the torchrun job's group (NCCL with one GPU per local rank, else gloo), train, leave. The
    configuration is checked after joining (:func:`~burstattn.train.job.agreed_plan`): a bad flag on any
    worker, or workers launched with different settings, raise on every worker (none is left waiting)."""
    local_rank = int(os.environ["LOCAL_RANK"])
    backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() > local_rank else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    if backend == "nccl" and cfg.offload_optimizer:  # the gradient norm of host-resident shards: gloo (torchtitan's)
        backend = "cuda:nccl,cpu:gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=cfg.pg_timeout_s))
    try:
        return train(cfg, progress=progress)
    finally:
        dist.destroy_process_group()


def run_training(cfg: TrainConfig, world_size: Optional[int] = None, *, threads_per_rank: int = 1,
                 progress: bool = True, environ: Optional[Mapping[str, str]] = None) -> list[dict]:
    """Train ``cfg`` under torchrun when its environment is present, else on ``world_size`` (default 1)
    local processes. The configuration is checked (:func:`~burstattn.train.checks.check_config`)
    before any local rank starts; torchrun's workers check it after joining and compare it across the
    workers (:func:`~burstattn.train.job.agreed_plan`). Returns rank 0's metrics records.

    Raises:
        ValueError: a bad configuration, or torchrun workers launched with different settings; ``world_size`` given under torchrun with another value, or
            not positive.
        burstattn.testing.launch.LocalGroupError: a local rank failed (its traceback inside).
    """
    environ = os.environ if environ is None else environ
    if torchrun_env(environ):
        if world_size is not None and world_size != int(environ["WORLD_SIZE"]):
            raise ValueError(f"--world-size {world_size} but torchrun started WORLD_SIZE={environ['WORLD_SIZE']}")
        return run_torchrun(cfg, progress)
    world_size = 1 if world_size is None else world_size
    if world_size < 1:
        raise ValueError(f"--world-size must be positive, got {world_size}")
    gpus = torch.cuda.is_available() and torch.cuda.device_count() >= world_size  # LocalPool's choice of nccl
    check_config(cfg, world_size, "cuda" if gpus else "cpu")
    return run_local(_rank_main, world_size, cfg, progress, threads_per_rank=threads_per_rank,
                     timeout_s=RUN_FOREVER_S, pg_timeout_s=cfg.pg_timeout_s)[0]

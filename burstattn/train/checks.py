"""Every check of a training configuration that needs no process group (pure, but for reading
the ``--data`` file and looking at ``--ckpt-dir``).

``burstattn train`` runs :func:`check_config` in the parent before it starts any rank, so a bad
flag costs no spawn and is printed once; :func:`~burstattn.train.job.build_job` runs it again on
every rank (the same checks, the same message on every rank). The planner asks
:func:`check_parallel` whether ``burstattn train`` can run a configuration it ranks.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..models.config import LlamaConfig, hybrid_tp_problem, preset
from ..models.head_chunks import head_chunks_problem
from ..parallel import TP_STRATEGIES, ParallelDims, default_layout, resolve_dims, shard_positions, tp_problem
from ..strategies import STRATEGIES
from ..strategies.heads import heads_problem
from .config import TrainConfig
from .data import PasskeyData, scan_tokens
from .dispatch_step import dispatch_problem, uses_dispatch
from .documents import DocLengths, load_offsets

TRAIN_SCHEDULES = ("ring", "distflash")


@dataclass(frozen=True)
class ParallelPlan:
    """What a configuration resolves to: degrees, the attention strategy over ``cp`` (``burst``
    for ``tp-v1``/``tp-v3``), the TP variant, the layout and usp's Ulysses degree (1 otherwise)."""

    dims: ParallelDims
    strategy: str
    variant: str
    layout: str
    ulysses: int


def model_config(cfg: TrainConfig) -> LlamaConfig:
    """The model of ``cfg``: the preset ``cfg.model``, with ``cfg.vocab_size`` when given."""
    model = preset(cfg.model)
    return model.with_overrides(vocab_size=cfg.vocab_size) if cfg.vocab_size else model


def choose_ulysses(cp: int, heads: int, given: int) -> int:
    """USP's Ulysses degree: ``given``, or the largest divisor of ``cp`` that divides ``heads``."""
    if given:
        return given
    return max(u for u in range(1, cp + 1) if cp % u == 0 and heads % u == 0)


def check_parallel(cfg: TrainConfig, world_size: int, model: Optional[LlamaConfig] = None) -> ParallelPlan:
    """The degrees, strategy, layout and sequence split of ``cfg`` on ``world_size`` ranks.

    Raises:
        ValueError: naming the flag, for degrees that do not multiply to the world size, a batch
            that does not split over ``dp``, a layout the strategy lacks, a sequence or heads that
            do not split, or a model that cannot be split ``tp`` ways (one with Gated DeltaNet
            layers: no tensor parallelism at all).
    """
    model = model or model_config(cfg)
    dims = resolve_dims(world_size, cfg.strategy, cfg.dp, cfg.cp, cfg.tp)
    problem = hybrid_tp_problem(model, cfg.strategy, dims.tp)
    if problem:
        raise ValueError(problem)
    strategy = "burst" if cfg.strategy in TP_STRATEGIES else cfg.strategy
    variant = cfg.strategy[3:] if cfg.strategy in TP_STRATEGIES else cfg.tp_variant
    if cfg.schedule not in TRAIN_SCHEDULES:
        hint = (": the two-level ring needs a node topology; call burstattn.attention(..., schedule='double', "
                "topology=burstattn.two_level_groups(ranks_per_node))" if cfg.schedule == "double" else "")
        raise ValueError(f"--schedule must be one of {list(TRAIN_SCHEDULES)}, got {cfg.schedule!r}{hint}")
    if cfg.schedule != "ring" and strategy != "burst":
        raise ValueError(f"--schedule {cfg.schedule} is an option of --strategy burst, not {cfg.strategy!r}")
    layout = cfg.layout or ("contiguous" if cfg.schedule == "distflash" else default_layout(strategy))
    if cfg.schedule == "distflash" and layout != "contiguous":
        raise ValueError(f"--schedule distflash balances the contiguous layout, got --layout {layout}")
    spec = STRATEGIES[strategy]
    if layout not in spec.layouts:
        raise ValueError(f"strategy {strategy!r} supports layout(s) {list(spec.layouts)}, got {layout!r}")
    if cfg.batch % dims.dp:
        raise ValueError(f"--batch ({cfg.batch}) must be divisible by --dp ({dims.dp}): it is the global batch, "
                         "split over the data-parallel replicas")
    if dims.tp > 1:
        problem = tp_problem(model, dims.tp, cfg.seq_len // dims.cp, variant)
        if problem:
            raise ValueError(problem)
    heads = model.n_heads // dims.tp
    ulysses = 1
    if strategy == "ulysses" and dims.cp > 1:
        problem = heads_problem(heads, dims.cp, "ulysses", "cp degree")
        if problem:
            raise ValueError(problem)
    if strategy == "usp":
        ulysses = choose_ulysses(dims.cp, heads, cfg.ulysses_degree)
        if dims.cp % ulysses or heads % ulysses:
            raise ValueError(f"--ulysses-degree ({ulysses}) must divide --cp ({dims.cp}) and the query heads per "
                             f"tp rank ({heads})")
    elif cfg.ulysses_degree:
        raise ValueError(f"--ulysses-degree is an option of --strategy usp, not {cfg.strategy!r}")
    head_chunks_check(cfg, model, dims, strategy, ulysses)
    for rank in (0, dims.cp - 1) if not uses_dispatch(cfg) else ():  # dispatch pads each sequence itself
        try:
            shard_positions(cfg.seq_len, strategy=strategy, layout=layout, cp_rank=rank, cp_size=dims.cp,
                            ulysses_degree=ulysses)
        except ValueError as exc:
            raise ValueError(f"--seq-len {cfg.seq_len}: {exc}") from None
    return ParallelPlan(dims, strategy, variant, layout, ulysses)


def head_chunks_check(cfg: TrainConfig, model: LlamaConfig, dims: ParallelDims, strategy: str, ulysses: int) -> None:
    """``--head-chunks`` must split this tp rank's heads into whole GQA groups, and each group's query
    heads must still split over a head-parallel strategy's degree. Raises ``ValueError``."""
    if cfg.head_chunks == 1:
        return
    heads, kv_heads = model.n_heads // dims.tp, max(1, model.n_kv_heads // dims.tp)
    problem = head_chunks_problem(cfg.head_chunks, heads, kv_heads)
    degree = dims.cp if strategy == "ulysses" else ulysses if strategy == "usp" else 1
    if problem is None and (heads // cfg.head_chunks) % degree:
        problem = (f"head_chunks ({cfg.head_chunks}) leaves {heads // cfg.head_chunks} query heads per group, not "
                   f"divisible by {strategy}'s degree ({degree})")
    if problem:
        raise ValueError(f"--head-chunks: {problem}")


def check_config(cfg: TrainConfig, world_size: int, device_type: str = "cpu") -> ParallelPlan:
    """:func:`check_parallel`, and the rest a run needs: the dtype on this device, the data (the
    ``--data`` file's length and largest token id against the vocabulary), and with ``--resume`` an
    existing ``--ckpt-dir``.

    Raises:
        ValueError: naming the flag and what was expected.
    """
    model = model_config(cfg)
    plan = check_parallel(cfg, world_size, model)
    if cfg.dtype == "float16" and device_type == "cpu":
        raise ValueError("--dtype float16 needs a GPU (use bfloat16 on CPU)")
    dispatch_check(cfg, plan)
    if cfg.doc_lengths:
        pass  # synthetic documents: byte ids of letters, any length
    elif cfg.data:
        tokens, largest = scan_tokens(cfg.data, cfg.data_format)
        if tokens < cfg.seq_len:
            raise ValueError(f"--data: {cfg.data!r} holds {tokens} tokens, fewer than --seq-len {cfg.seq_len}")
        if largest >= model.vocab_size:
            raise ValueError(f"--data holds token id {largest} but model {cfg.model!r} has vocab_size "
                             f"{model.vocab_size}: pass --vocab-size {largest + 1} (or more) for this tokenizer")
    elif cfg.seq_len < PasskeyData.MIN_LEN:
        raise ValueError(f"the synthetic passkey task needs --seq-len >= {PasskeyData.MIN_LEN}, got {cfg.seq_len} "
                         "(or train on a --data file)")
    elif PasskeyData.largest_id() >= model.vocab_size:
        largest = PasskeyData.largest_id()
        raise ValueError(f"the synthetic passkey task writes byte token ids up to {largest} ({chr(largest)!r}) but "
                         f"model {cfg.model!r} has vocab_size {model.vocab_size}: pass --vocab-size {largest + 1} "
                         "(or more; 256 holds every byte), or train on a --data file")
    if cfg.resume and not Path(cfg.ckpt_dir).is_dir():
        raise ValueError(f"--resume: --ckpt-dir {cfg.ckpt_dir!r} does not exist (mistyped?); drop --resume to "
                         "start a fresh run there")
    return plan


def dispatch_check(cfg: TrainConfig, plan: ParallelPlan) -> None:
    """``--dispatch`` and the documents flags: ``ValueError`` naming the flag (pure but for reading
    ``--doc-offsets``)."""
    problem = dispatch_problem(cfg, plan.dims.dp, plan.dims.cp, plan.dims.tp, plan.strategy)
    if problem:
        raise ValueError(problem)
    if cfg.doc_lengths:
        DocLengths.parse(cfg.doc_lengths)
    if cfg.doc_offsets:
        load_offsets(cfg.doc_offsets)


def __getattr__(name: str):
    # names that moved out of this module (the table burstattn.MOVED): resolved, or refused with the new spelling
    return sys.modules["burstattn"].moved_attribute(__name__, name)

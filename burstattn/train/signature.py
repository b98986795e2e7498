"""What every rank of a training job must agree on, compared at job start (:func:`run_signature`).

Ranks started by hand or by a launcher with per-node commands can be given different flags; a
different ``--seed`` or ``--lr`` then trains silently wrong, a different ``--vocab-size`` ends in a
collective of mismatched sizes. :func:`~burstattn.train.job.build_job` therefore compares, through
:func:`burstattn.comm.agree.agree` (one all-gather of 8 bytes per rank), every field of the
:class:`~burstattn.train.config.TrainConfig` as it resolves on this rank:

* values resolved where a default stands for one: the degrees, the layout, usp's Ulysses degree, the
  vocabulary and the blockwise chunks (``None`` and the value it resolves to agree);
* the data by what it holds: ``--data`` and ``--doc-offsets`` by their content (size and CRC-32), not
  their paths, which may differ between hosts; the seed (data and initial weights) as a field;
* ``--ckpt-dir`` only by whether it is set (every rank saves: a collective; the path may be rank-local);
  ``--metrics`` not at all (rank 0 alone writes it);
* the model's resolved architecture and the burstattn version (ranks on different installs).

A ``--config`` file has been read into the fields before: its content is compared, never its path.
"""
from __future__ import annotations

from dataclasses import asdict, fields
from pathlib import Path

from .checks import ParallelPlan
from .config import TrainConfig
from .data import FileData, content_id

RANK_LOCAL = ("metrics",)  # written by rank 0 alone: not compared
COMPARED_ELSEWHERE = ("vocab_size", "mlp_chunk", "loss_chunk", "fused_loss")  # not part of "architecture"
HINT = "launch every rank with the same flags and --config content (the same data on every host)"


def _resolved(cfg: TrainConfig, plan: ParallelPlan, model) -> dict:
    """The fields whose value on this rank is not the text of the field itself."""
    data_format = cfg.data_format
    if cfg.data and data_format == "auto":
        data_format = FileData.guess_format(Path(cfg.data))
    return {
        "vocab_size": model.vocab_size, "dp": plan.dims.dp, "cp": plan.dims.cp, "tp": plan.dims.tp,
        "layout": plan.layout, "ulysses_degree": plan.ulysses if plan.strategy == "usp" else cfg.ulysses_degree,
        "mlp_chunk": model.mlp_chunk, "loss_chunk": model.loss_chunk, "data_format": data_format,
        "data": None if cfg.data is None else f"content {content_id(cfg.data)}",
        "doc_offsets": None if cfg.doc_offsets is None else f"content {content_id(cfg.doc_offsets)}",
        "ckpt_dir": "set" if cfg.ckpt_dir else None,
    }


def run_signature(cfg: TrainConfig, plan: ParallelPlan, model) -> tuple[tuple[str, str], ...]:
    """``((field, value text), ...)`` of this rank's run: every TrainConfig field as it resolves here (the
    module docstring), then the model's architecture and the library version. ``plan``: what
    :func:`~burstattn.train.checks.check_config` resolved; ``model``: the model config with its chunks."""
    import burstattn

    resolved = _resolved(cfg, plan, model)
    pairs = []
    for f in fields(cfg):
        if f.name in RANK_LOCAL:
            continue
        value = resolved.get(f.name, getattr(cfg, f.name))
        text = value if f.name in ("data", "doc_offsets") and value is not None else repr(value)
        pairs.append((f.name, text))  # the TOML key; the flag is the same with dashes
        if f.name == "model":
            arch = {k: v for k, v in asdict(model).items() if k not in COMPARED_ELSEWHERE}
            pairs.append((f"the architecture of model (resolved; {type(model).__name__})", repr(arch)))
    pairs.append(("burstattn version", burstattn.__version__))
    return tuple(pairs)

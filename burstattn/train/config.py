"""``TrainConfig``: everything one training run needs (a TOML file with ``--config``, flags override)."""
from __future__ import annotations

import tomllib
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Mapping, Optional

from ..config import LOW_DTYPES as DTYPES  # names only: no torch at import
OFFLOAD = ("none", "inputs", "all")  # burstattn.models.offload.OFFLOAD (names only; kept equal by a test)
DATA_FORMATS = ("auto", "uint16", "uint32", "text")
TARGETS = ("all", "answer")
DISPATCH = ("static", "dynamic")  # burstattn.parallel.dispatch.MODES (names only)


@dataclass(frozen=True)
class TrainConfig:
    """One training run. Degrees left ``None`` are resolved by :func:`burstattn.parallel.resolve_dims`."""

    model: str = "tiny"
    """Model preset name (``burstattn.models.PRESETS``)."""
    vocab_size: Optional[int] = None
    """Token ids of the model (``None``: the preset's; the small presets have 256, the byte-level
    tokenizer's): set it to a tokenizer's vocabulary to train on its ``--data`` token file."""
    seq_len: int = 256
    """Tokens per global sequence (split over the ``cp`` ranks)."""
    batch: int = 2
    """Sequences per global batch (split over the ``dp`` ranks)."""
    steps: int = 100
    """Optimizer steps of the run (a resumed run stops at the same total)."""
    lr: float = 3e-3
    """Peak learning rate of AdamW."""
    warmup: int = 10
    """Linear warm-up steps; then cosine decay to ``lr * min_lr_ratio`` at ``steps``."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of ``lr``."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adam_eps: float = 1e-8
    """AdamW's epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0: no clipping)."""
    seed: int = 0
    """Seeds the initial weights and the data: the same whatever the parallel layout."""
    strategy: str = "burst"
    """Any strategy of ``burstattn.attention`` (context parallel over ``cp``), or ``tp-v1``/``tp-v3``."""
    layout: Optional[str] = None
    """Sequence layout over ``cp`` (``None``: the strategy's default)."""
    backend: str = "auto"
    """Local attention kernel (``burstattn.attention``'s ``backend``)."""
    schedule: str = "ring"
    """``burst`` only: ``ring`` or ``distflash`` (DistFlashAttn's load-balanced causal schedule over the
    contiguous layout, the default layout with it). ``double`` needs a node topology the job does
    not build: ``burstattn.attention(..., schedule="double", topology=...)``."""
    ulysses_degree: int = 0
    """``usp`` only: Ulysses ranks inside each ring group (0: the largest that divides cp and the heads)."""
    dp: Optional[int] = None
    """Data-parallel degree (default 1)."""
    cp: Optional[int] = None
    """Context-parallel degree (default: the rest of the world for a sequence strategy)."""
    tp: Optional[int] = None
    """Tensor-parallel degree (default: the rest of the world for ``tp-v1``/``tp-v3``, else 1)."""
    tp_variant: str = "v3"
    """TP style inside a sequence strategy with ``tp > 1``: ``v1`` or ``v3``."""
    fsdp: bool = False
    """Shard parameters, gradients and optimizer state with FSDP2 over ``dp x cp``."""
    zero: int = 3
    """With ``fsdp``: 3 (reshard after forward) or 2 (keep gathered parameters until the backward)."""
    checkpointing: str = "none"
    """Activation checkpointing: ``none``, ``full`` (per layer) or ``remat`` (keep each layer's input,
    attention output and LSE; the distributed attention forward never reruns)."""
    mlp_chunk: Optional[int] = None
    """Blockwise MLP: tokens of the local sequence per chunk, each recomputed in the backward (0: the
    whole local sequence; ``None``: automatic, whole up to 2 x 2,048 local tokens, then chunks of
    ``max(2048, dim)``; see :func:`burstattn.models.auto_chunks`)."""
    loss_chunk: Optional[int] = None
    """Blockwise loss: tokens per chunk of the fused final norm + output projection + cross-entropy,
    so the ``[tokens, vocab]`` logits never exist (0: whole; ``None``: automatic, about 16M logits
    per chunk once the local logits exceed twice that)."""
    fused_loss: bool = False
    """The fused blockwise loss: each loss chunk's gradients computed in its forward (the head's input
    and a float32 ``vocab x dim`` weight-gradient accumulator kept until the backward), nothing
    recomputed (see :mod:`burstattn.models.fused_loss`). The same result."""
    offload: str = "none"
    """Saved activations in host memory between forward and backward: ``none``, ``inputs`` (the
    layer inputs) or ``all`` (also, under ``remat``, the attention outputs and LSE). A no-op on CPU."""
    offload_optimizer: bool = False
    """With ``fsdp``: FSDP2's ``CPUOffloadPolicy``: the sharded parameters, their gradients and the
    optimizer state live in host memory and AdamW steps on the CPU (ZeRO-Offload; DeepSpeed ALST's
    one-GPU runs); the device holds only the parameters gathered for the layer computing."""
    head_chunks: int = 1
    """Run each layer's distributed attention over this many groups of heads, one group after another
    (:mod:`burstattn.models.head_chunks`): the call's buffers scale with one group. Must divide
    the kv heads per tensor-parallel rank."""
    dtype: str = "float32"
    """Compute dtype (with ``fsdp``: FSDP's param dtype; master weights and reductions stay float32)."""
    data: Optional[str] = None
    """A local token file (uint16/uint32, nanoGPT's ``.bin``) or UTF-8 text; ``None``: synthetic passkey."""
    data_format: str = "auto"
    """``auto`` (``.txt``/``.md`` -> text, ``.u32`` -> uint32, else uint16), ``uint16``, ``uint32``, ``text``."""
    targets: str = "all"
    """Which labels the loss scores: ``all`` (every next token: language modelling) or ``answer``
    (only the answer tokens, the passkey digits; the rest is context, as in supervised fine-tuning
    with the prompt masked). Either way the loss is the mean over the targets of the global batch."""
    dispatch: str = "static"
    """``static``: every sequence over the fixed ``dp x cp`` mesh (today's behaviour); ``dynamic``: every
    sequence of each step's global batch gets its own cp degree and group of ranks, balancing the ranks'
    estimated cost (:mod:`burstattn.parallel.dispatch`; DDP gradient sums, no ``fsdp``/``tp``)."""
    doc_lengths: Optional[str] = None
    """Synthetic documents of long-tailed lengths, ``lognormal:MEDIAN,SIGMA,MAX``: ``batch x seq_len``
    tokens per step cut into documents, each its own causal sequence."""
    eod_id: Optional[int] = None
    """With ``data``: the end-of-document token id; the file's windows are cut into documents after it."""
    doc_offsets: Optional[str] = None
    """With ``data``: a text file of document start offsets (one token offset a line)."""
    dispatch_budget: Optional[int] = None
    """Tokens one rank may hold of one sequence (and of one packed micro-batch) under dispatch
    (``None``: no limit per sequence; micro-batches of at most ``seq_len`` tokens)."""
    ckpt_dir: Optional[str] = None
    """Directory of ``step-N`` checkpoints (``None``: no checkpoints)."""
    ckpt_every: int = 0
    """Save every this many steps (0: only at the end, when ``ckpt_dir`` is set)."""
    keep: int = 3
    """Keep the newest this many checkpoints."""
    resume: bool = False
    """Continue from the newest checkpoint in ``ckpt_dir`` that loads (damaged ones are skipped, with
    the reason); ``ckpt_dir`` must exist."""
    allow_changes: bool = False
    """With ``resume``: accept a run whose data or optimisation settings (seed, lr, batch, ...)
    differ from the checkpoint's (warned; the new values apply); without it they are refused."""
    metrics: Optional[str] = None
    """JSON-lines file: one object per step (``step, loss, tokens_per_s, peak_mem_bytes, lr`` ...)."""
    log_every: int = 1
    """Progress (and accuracy evaluation) every this many steps."""
    pg_timeout_s: float = 600.0
    """Collective timeout: a dead peer makes the others raise after this long."""

    def __post_init__(self) -> None:
        for name in ("seq_len", "batch", "steps", "keep", "log_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("lr", "min_lr_ratio", "weight_decay", "adam_eps", "grad_clip", "pg_timeout_s"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), (int, float)):
                raise ValueError(f"{name} must be a number, got {getattr(self, name)!r}")
        if not isinstance(self.head_chunks, int) or isinstance(self.head_chunks, bool) or self.head_chunks < 1:
            raise ValueError(f"head_chunks (--head-chunks) must be a positive int, got {self.head_chunks!r}")
        if self.offload_optimizer and not self.fsdp:
            raise ValueError("offload_optimizer (--offload-optimizer) is FSDP2's CPUOffloadPolicy: it needs --fsdp")
        for name in ("warmup", "ckpt_every", "ulysses_degree"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"{name} must be a non-negative int, got {getattr(self, name)!r}")
        for name in ("mlp_chunk", "loss_chunk"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(f"{name} (--{name.replace('_', '-')}) must be a non-negative int (tokens per chunk, "
                                 f"0: the whole local sequence), got {value!r}")
        if self.offload not in OFFLOAD:
            raise ValueError(f"offload (--offload) must be one of {OFFLOAD}, got {self.offload!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.data_format not in DATA_FORMATS:
            raise ValueError(f"data_format must be one of {DATA_FORMATS}, got {self.data_format!r}")
        if self.targets not in TARGETS:
            raise ValueError(f"targets must be one of {TARGETS}, got {self.targets!r}")
        if self.targets == "answer" and self.data:
            raise ValueError("targets = 'answer' needs the synthetic passkey task (a --data file has no answers)")
        if self.dispatch not in DISPATCH:
            raise ValueError(f"dispatch (--dispatch) must be one of {DISPATCH}, got {self.dispatch!r}")
        if self.doc_lengths and (self.data or self.targets == "answer"):
            raise ValueError("doc_lengths (--doc-lengths) is a synthetic documents source: it excludes --data and "
                             "--targets answer")
        if self.dispatch_budget is not None and (not isinstance(self.dispatch_budget, int)
                                                 or isinstance(self.dispatch_budget, bool) or self.dispatch_budget < 1):
            raise ValueError(f"dispatch_budget (--dispatch-budget) must be a positive int (tokens per rank), "
                             f"got {self.dispatch_budget!r}")
        if self.zero not in (2, 3):
            raise ValueError(f"zero must be 2 or 3, got {self.zero!r}")
        if self.lr <= 0:
            raise ValueError(f"lr must be positive, got {self.lr!r}")
        if self.resume and not self.ckpt_dir:
            raise ValueError("resume needs ckpt_dir")
        if self.vocab_size is not None and (not isinstance(self.vocab_size, int) or isinstance(self.vocab_size, bool)
                                            or self.vocab_size < 1):
            raise ValueError(f"vocab_size must be a positive int, got {self.vocab_size!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def with_overrides(self, **overrides: Any) -> "TrainConfig":
        return replace(self, **overrides)


def config_from_mapping(values: Mapping[str, Any], base: Optional[TrainConfig] = None) -> TrainConfig:
    """``base`` (default ``TrainConfig()``) with the fields in ``values`` replaced; unknown keys raise
    ``ValueError`` naming them (TOML keys may use ``-`` or ``_``)."""
    known = {f.name for f in fields(TrainConfig)}
    clean = {k.replace("-", "_"): v for k, v in values.items()}
    unknown = sorted(set(clean) - known)
    if unknown:
        raise ValueError(f"train config: unknown field(s) {unknown}; known: {sorted(known)}")
    return replace(base or TrainConfig(), **clean)


def load_config(path: str | Path, **overrides: Any) -> TrainConfig:
    """A TOML file (flat keys, or under a ``[train]`` table) with ``overrides`` on top.

    Raises:
        ValueError: one line naming the file: it cannot be read (missing, a directory), its TOML does not
            parse (with the parser's line and column), or it holds an unknown field or a bad value.
    """
    try:
        with open(path, "rb") as f:
            values = tomllib.load(f)
    except OSError as e:
        raise ValueError(f"--config {str(path)!r}: cannot read it: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"--config {str(path)!r}: not valid TOML: {e}") from None
    values = values.get("train", values)
    try:
        return config_from_mapping({**values, **overrides})
    except (TypeError, ValueError) as e:
        try:  # the file's own values alone: the same error names the file, else it came from the flags
            config_from_mapping(values)
            alone = None
        except (TypeError, ValueError) as f:
            alone = str(f)
        raise ValueError(f"--config {str(path)!r}: {e}" if alone == str(e) else str(e)) from None

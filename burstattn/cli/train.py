"""``burstattn train``: flags (over an optional TOML ``--config``), launching, error reporting.

    burstattn train --config configs/train/passkey.toml --world-size 2 --metrics run.jsonl
    torchrun --nproc-per-node 8 -m burstattn.cli train --model llama-7b --seq-len 131072 --fsdp
"""
from __future__ import annotations

import argparse
import dataclasses
import signal
import sys

HELP = "train a LLaMA-style model with sequence / tensor parallelism"
# flag -> (type, help); every one overrides the TrainConfig field of the same name
FLAGS = {
    "model": (str, "model preset (tiny, small, llama-7b, ...)"),
    "seq_len": (int, "tokens per global sequence"),
    "batch": (int, "sequences per global batch"),
    "steps": (int, "optimizer steps"),
    "lr": (float, "peak learning rate (AdamW)"),
    "warmup": (int, "linear warm-up steps"),
    "weight_decay": (float, "AdamW weight decay"),
    "grad_clip": (float, "global gradient-norm clip (0: off)"),
    "seed": (int, "seed of the initial weights and the data (the same whatever the layout)"),
    "strategy": (str, "any strategy of burstattn.attention (context parallel), or tp-v1 / tp-v3"),
    "layout": (str, "sequence layout over cp (default: the strategy's)"),
    "backend": (str, "local attention kernel"),
    "ulysses_degree": (int, "usp: Ulysses ranks per ring group (0: largest that fits)"),
    "dp": (int, "data-parallel degree"),
    "cp": (int, "context-parallel degree"),
    "tp": (int, "tensor-parallel degree"),
    "tp_variant": (str, "v1 or v3: the TP style inside a sequence strategy with --tp > 1"),
    "zero": (int, "with --fsdp: 3 (reshard after forward) or 2 (keep gathered parameters)"),
    "checkpointing": (str, "none | full | remat"),
    "dtype": (str, "float32 | bfloat16 | float16"),
    "data": (str, "token file (uint16/uint32) or UTF-8 text; default: synthetic passkey task"),
    "data_format": (str, "auto | uint16 | uint32 | text"),
    "targets": (str, "all (every next token) | answer (only the passkey digits are scored)"),
    "ckpt_dir": (str, "directory of step-N checkpoints"),
    "ckpt_every": (int, "save every M steps (and at the end)"),
    "keep": (int, "keep the newest K checkpoints"),
    "metrics": (str, "JSON-lines file, one object per step"),
    "log_every": (int, "progress every this many steps"),
    "pg_timeout_s": (float, "collective timeout in seconds (a dead peer -> error after this long)"),
}
SWITCHES = {"fsdp": "shard parameters/gradients/optimizer state with FSDP2 over dp x cp",
            "resume": "continue from the newest complete checkpoint in --ckpt-dir"}


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help=HELP,
                       description="Train on local processes (--world-size) or under torchrun (detected). "
                                   "Flags override the fields of --config.")
    p.add_argument("--config", help="TOML file of TrainConfig fields (see configs/train/)")
    p.add_argument("--world-size", type=int, default=None, help="local processes (default 1; ignored under torchrun)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per local process")
    p.add_argument("--no-progress", action="store_true", help="no progress display")
    for name, (kind, text) in FLAGS.items():
        flag = "--pg-timeout" if name == "pg_timeout_s" else "--" + name.replace("_", "-")
        p.add_argument(flag, dest=name, type=kind, default=argparse.SUPPRESS, help=text)
    for name, text in SWITCHES.items():
        p.add_argument("--" + name, dest=name, action="store_true", default=argparse.SUPPRESS, help=text)
    p.set_defaults(handler=run)


def config_of(ns: argparse.Namespace):
    """The TrainConfig of the parsed flags (``--config`` first, flags on top)."""
    from ..train.config import TrainConfig, config_from_mapping, load_config

    names = {f.name for f in dataclasses.fields(TrainConfig)}
    overrides = {k: v for k, v in vars(ns).items() if k in names}
    return load_config(ns.config, **overrides) if ns.config else config_from_mapping(overrides)


def run(ns: argparse.Namespace) -> int:
    from ..testing.launch import LocalGroupError
    from ..train.launcher import run_training

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: the local ranks are stopped too
    try:
        cfg = config_of(ns)
        records = run_training(cfg, ns.world_size, threads_per_rank=ns.threads, progress=not ns.no_progress)
    except ValueError as exc:
        print(f"burstattn train: error: {exc}", file=sys.stderr)
        return 2
    except LocalGroupError as exc:
        first = min(exc.errors)
        print(f"burstattn train: failed: {exc.summary}", file=sys.stderr)
        for rank in sorted(exc.errors):
            print(f"  {exc.errors[rank].message}", file=sys.stderr)
        return 2 if "ValueError" in exc.errors[first].type_names else 1
    if records:
        last = records[-1]
        acc = "" if last.get("accuracy") is None else f", passkey accuracy {last['accuracy']:.2f}"
        print(f"burstattn train: {last['step']} steps, final loss {last['loss']:.4f}{acc}")
    return 0

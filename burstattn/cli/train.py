"""``burstattn train``: flags (over an optional TOML ``--config``), launching, error reporting.

    burstattn train --config configs/train/passkey.toml --world-size 2 --metrics run.jsonl
    burstattn train --dry-run --model llama3-8b --seq-len 1048576 --world-size 32 --dtype bfloat16 --fsdp --json
    torchrun --nproc-per-node 8 -m burstattn.cli train --model llama-7b --seq-len 131072 --fsdp
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys

from . import dryrun

HELP = "train a LLaMA-style model with sequence / tensor parallelism"
# flag -> (type, help); every one overrides the TrainConfig field of the same name
FLAGS = {
    "model": (str, "model preset (tiny, small, llama-7b, ...)"),
    "vocab_size": (int, "token ids of the model (default: the preset's; 256 for the small ones): a --data "
                        "file's tokenizer vocabulary, e.g. 50304 for GPT-2 ids"),
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
    "schedule": (str, "burst: ring | distflash (DistFlashAttn's balanced causal schedule, contiguous layout)"),
    "ulysses_degree": (int, "usp: Ulysses ranks per ring group (0: largest that fits)"),
    "dp": (int, "data-parallel degree"),
    "cp": (int, "context-parallel degree"),
    "tp": (int, "tensor-parallel degree"),
    "tp_variant": (str, "v1 or v3: the TP style inside a sequence strategy with --tp > 1"),
    "zero": (int, "with --fsdp: 3 (reshard after forward) or 2 (keep gathered parameters)"),
    "checkpointing": (str, "none | full | remat"),
    "mlp_chunk": (int, "blockwise MLP: TOKENS of the local sequence per chunk (0: whole; default: automatic)"),
    "loss_chunk": (int, "blockwise loss: TOKENS per chunk of norm + head + cross-entropy (0: whole; default: "
                        "automatic)"),
    "offload": (str, "none | inputs | all: saved activations in host memory until the backward (no-op on CPU)"),
    "head_chunks": (int, "run each layer's attention over this many groups of heads, one after another (the "
                         "call's buffers scale with one group; must divide the kv heads per tp rank)"),
    "dtype": (str, "float32 | bfloat16 | float16"),
    "data": (str, "token file (uint16/uint32) or UTF-8 text; default: synthetic passkey task"),
    "data_format": (str, "auto | uint16 | uint32 | text"),
    "targets": (str, "all (every next token) | answer (only the passkey digits are scored)"),
    "dispatch": (str, "static (every sequence over the fixed dp x cp mesh) | dynamic (every sequence its own cp "
                      "degree and ranks, chosen each step to balance the ranks' cost)"),
    "doc_lengths": (str, "synthetic documents of long-tailed lengths: lognormal:MEDIAN,SIGMA,MAX"),
    "eod_id": (int, "with --data: end-of-document token id (the file is cut into documents after it)"),
    "doc_offsets": (str, "with --data: text file of document start offsets, one a line"),
    "dispatch_budget": (int, "tokens one rank may hold of one sequence / micro-batch under dispatch"),
    "ckpt_dir": (str, "directory of step-N checkpoints"),
    "ckpt_every": (int, "save every M steps (and at the end)"),
    "keep": (int, "keep the newest K checkpoints"),
    "metrics": (str, "JSON-lines file, one object per step"),
    "log_every": (int, "progress every this many steps"),
    "pg_timeout_s": (float, "collective timeout in seconds (a dead peer -> error after this long)"),
}
SWITCHES = {"fsdp": "shard parameters/gradients/optimizer state with FSDP2 over dp x cp",
            "offload_optimizer": "with --fsdp: parameters, gradients and optimizer state in host memory, AdamW "
                                 "on the CPU (FSDP2's CPUOffloadPolicy)",
            "fused_loss": "the loss chunks' gradients computed in the forward (no recomputation; keeps a "
                          "float32 vocab x dim weight gradient until the backward)",
            "resume": "continue from the newest checkpoint in --ckpt-dir that loads (the directory must exist)",
            "allow_changes": "with --resume: accept another --seed, --lr, --batch ... than the checkpoint's run "
                             "(warned; refused without this)"}


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help=HELP,
                       description="Train on local processes (--world-size) or under torchrun (detected). "
                                   "Flags override the fields of --config.")
    p.add_argument("--config", help="TOML file of TrainConfig fields (see configs/train/)")
    p.add_argument("--world-size", type=int, default=None,
                   help="local processes (default 1); under torchrun optional, and when given it must equal "
                        "torchrun's WORLD_SIZE (a mismatch is an error)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per local process")
    p.add_argument("--no-progress", action="store_true", help="no progress display")
    dryrun.add_flags(p)
    for name, (kind, text) in FLAGS.items():
        flag = "--pg-timeout" if name == "pg_timeout_s" else "--" + name.replace("_", "-")
        metavar = "TOKENS" if name in ("mlp_chunk", "loss_chunk") else None
        p.add_argument(flag, dest=name, type=kind, default=argparse.SUPPRESS, help=text, metavar=metavar)
    for name, text in SWITCHES.items():
        p.add_argument("--" + name.replace("_", "-"), dest=name, action="store_true", default=argparse.SUPPRESS,
                       help=text)
    p.set_defaults(handler=run)


def config_of(ns: argparse.Namespace):
    """The TrainConfig of the parsed flags (``--config`` first, flags on top)."""
    from ..train.config import TrainConfig, config_from_mapping, load_config

    names = {f.name for f in dataclasses.fields(TrainConfig)}
    overrides = {k: v for k, v in vars(ns).items() if k in names}
    return load_config(ns.config, **overrides) if ns.config else config_from_mapping(overrides)


def _say_error(text: str) -> None:
    # under torchrun every worker checks the flags: only global rank 0 prints, so the message shows once
    if os.environ.get("RANK", "0") == "0":
        print(f"burstattn train: error: {text}", file=sys.stderr)


def report_failure(exc) -> int:
    """Print a :class:`~burstattn.testing.launch.LocalGroupError` of the ranks: a message all the
    failing ranks share once (a bad configuration, a damaged checkpoint: the same on every rank),
    different ones one line per rank. Returns the exit code (2: a ValueError, else 1)."""
    messages = {rank: err.message for rank, err in exc.errors.items()}
    first = exc.errors[min(exc.errors)]
    if len(set(messages.values())) == 1 and first.traceback:  # every failing rank raised the same
        text = first.message.split(": ", 1)[1] if "ValueError" in first.type_names else first.message
        _say_error(text)
    else:
        print(f"burstattn train: failed: {exc.summary}", file=sys.stderr)
        for rank in sorted(messages):
            print(f"  {messages[rank]}", file=sys.stderr)
    return 2 if "ValueError" in first.type_names else 1


def run(ns: argparse.Namespace) -> int:
    from ..testing.launch import LocalGroupError
    from ..train.launcher import run_training

    before = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: the local ranks are stopped too
    try:
        cfg = config_of(ns)
        dryrun.check_flags(ns)
        if ns.dry_run:
            if cfg.dispatch == "dynamic" or cfg.doc_lengths or cfg.eod_id is not None or cfg.doc_offsets:
                raise ValueError("--dry-run models the fixed mesh's rows: not --dispatch dynamic or documents "
                                 "(--doc-lengths, --eod-id, --doc-offsets); see burstattn bench dispatch --simulate")
            return dryrun.run_dry(ns, cfg)
        records = run_training(cfg, ns.world_size, threads_per_rank=ns.threads, progress=not ns.no_progress)
    except ValueError as exc:
        _say_error(str(exc))
        return 2
    except LocalGroupError as exc:
        return report_failure(exc)
    finally:
        signal.signal(signal.SIGTERM, before)
    if records:
        last = records[-1]
        acc = "" if last.get("accuracy") is None else f", passkey accuracy {last['accuracy']:.2f}"
        print(f"burstattn train: {last['step']} steps, final loss {last['loss']:.4f}{acc}")
    return 0

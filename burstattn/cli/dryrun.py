"""``burstattn train --dry-run``: the flags, the printed report, the JSON line and ``--metrics``.

    burstattn train --dry-run --model llama3-8b --seq-len 1048576 --world-size 32 --dtype bfloat16 \\
        --checkpointing remat --fsdp --json
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys

GIB = 2**30


def add_flags(p: argparse.ArgumentParser) -> None:
    """The dry-run flags of ``burstattn train``."""
    p.add_argument("--dry-run", action="store_true",
                   help="run one optimizer step of this job on one rank with fake tensors and the fake process "
                        "group (any --world-size up to 1024, the full model and sequence): peak memory by category "
                        "and phase, host memory of offload, bytes sent, attention calls")
    p.add_argument("--dry-run-rank", type=int, default=0, metavar="R", help="with --dry-run: the rank to run (default 0)")
    p.add_argument("--json", action="store_true", help="with --dry-run: print the report as one JSON object (last line)")
    p.add_argument("--dry-run-device", choices=("cuda", "cpu"), default="cuda",
                   help="with --dry-run: the device the step is modelled for (default cuda: a GPU's fused AdamW and "
                        "attention workspace; cpu: this machine's, to compare with a real step here)")
    p.add_argument("--dry-run-kernel", choices=("sdpa", "flash_attn"), default="sdpa",
                   help="with --dry-run (device cuda): the GPU attention kernel whose buffers are counted (default "
                        "sdpa: PyTorch's own flash / cuDNN kernels, in every CUDA build; flash_attn: the flash-attn "
                        "package)")


def check_flags(ns: argparse.Namespace) -> None:
    """``ValueError`` for dry-run flags given without ``--dry-run``."""
    if not ns.dry_run and (ns.dry_run_rank != 0 or ns.json or ns.dry_run_device != "cuda"
                           or ns.dry_run_kernel != "sdpa"):
        raise ValueError("--dry-run-rank and --json are options of --dry-run (and --dry-run-device, --dry-run-kernel)")


def _gib(n: float) -> str:
    return f"{n / GIB:8.2f} GiB"


def format_report(r: dict) -> str:
    """The human-readable report of :func:`burstattn.train.dryrun.dry_run`."""
    d = r["dims"]
    lines = [f"dry run: rank {r['rank']} of {r['world_size']} (dp {d['dp']} x cp {d['cp']} x tp {d['tp']}), "
             f"{r['strategy']} / {r['layout']}, chunks mlp {r['chunks'][0]} loss {r['chunks'][1]}",
             f"  peak           {_gib(r['peak_bytes'])}  (the step's own: {_gib(r['step_peak_bytes'])})"]
    lines += [f"    {name:<12} {_gib(v)}" for name, v in r["peak_by_category"].items()]
    lines += [f"  peak in {name:<9}{_gib(v)}" for name, v in r["peak_by_phase"].items()]
    lines += [f"  kernel workspace {_gib(r['workspace_bytes'])}  ({r['workspace']})",
              f"  host (offload) {_gib(r['host_bytes'])}",
              f"  sent           {_gib(r['sent_bytes'])}  " + ", ".join(f"{k} {v / GIB:.2f}" for k, v in
                                                                      r["sent_by_op"].items()),
              f"  attention calls {r['attention_calls']}, kernel calls "
              + (", ".join(f"{k} {v}" for k, v in r["kernel_calls"].items()) if r.get("kernel_calls") else "-")
              + f" ({r.get('kernel', '')}), ops {r['ops']}, {r['seconds']:.1f} s"]
    if r.get("unmetered"):  # PyTorch's own collectives: not in "sent"
        lines.insert(-1, "    not metered: " + "; ".join(r["unmetered"]))
    return "\n".join(lines)


def run_dry(ns: argparse.Namespace, cfg) -> int:
    """Run the dry run of ``cfg`` (``--world-size``, ``--dry-run-rank``) and print it; with ``--metrics F``
    also write it to F (opened first, so that an unwritable F costs no dry run)."""
    from ..train.dryrun import DryRunError, dry_run

    with contextlib.ExitStack() as stack:
        metrics = stack.enter_context(_open_metrics(cfg.metrics)) if cfg.metrics else None
        try:
            report = dry_run(cfg, ns.world_size or 1, ns.dry_run_rank, device=ns.dry_run_device, kernel=ns.dry_run_kernel)
        except DryRunError as exc:
            print(f"burstattn train --dry-run: failed: {exc}", file=sys.stderr)
            return 1
        print(format_report(report))
        if ns.json:
            print(json.dumps(report))
        if metrics is not None:  # one line, the report (a real run writes one per step)
            metrics.write(json.dumps({"dry_run": True, **report}) + "\n")
    return 0


def _open_metrics(path: str):
    """``--metrics F`` opened for writing, or ``ValueError`` naming the flag."""
    try:
        return open(path, "w")
    except OSError as exc:
        raise ValueError(f"--metrics {path}: cannot write the dry run's report: {exc.strerror or exc}") from None

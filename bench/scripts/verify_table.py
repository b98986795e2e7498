"""The real-scale table of bench/results/simulation.md: the planner's predicted peak against the dry run's,
per strategy.

For one planning question (model, sequence, GPUs, cluster, dtype), the best plan of every strategy label the
planner offers is taken from its ranking (as ``burstattn plan`` prints it); its ``burstattn train`` command is
dry-run (``burstattn train --dry-run --json``, rank 0) once and the report kept under ``--store`` as
``NAME.json`` (with ``NAME.cmd``), so the table is rebuilt from stored dry runs after a change to the model.

    python -m bench.scripts.verify_table --seq-len 131072 --gpus 8 --commands        # NAME and command per strategy
    python -m bench.scripts.verify_table --seq-len 131072 --gpus 8 --run NAME        # dry-run one of them (minutes)
    python -m bench.scripts.verify_table --seq-len 131072 --gpus 8                   # the markdown rows

Strategy labels that share one ``train`` command (``burst(double)`` runs the one-level ring in ``train``) share
its dry run. The dry runs are CPU work of minutes each (llama3-8b at 1M tokens over 32 ranks: ~5 CPU minutes):
run them one at a time.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path

GIB = 2**30


def best_rows(args) -> dict:
    """``{label: row}``: the first (best) ranked row of each strategy label with a ``train`` command."""
    from burstattn.models.config import preset as model_preset
    from burstattn.sim.hardware import preset as hw_preset
    from burstattn.sim.planner import MemoryChoice, plan

    import torch

    rows = plan(model_preset(args.model), args.seq_len, args.gpus, hw_preset(args.cluster), "train", 1,
                model_name=args.model, fixed=MemoryChoice(dtype=getattr(torch, args.dtype)))
    out = {}
    for r in rows:
        if "train" in r.get("config", {}) and r["strategy"] not in out:
            out[r["strategy"]] = r
    return out


def name_of(args, command: str) -> str:
    """The stored dry run's name: the question and a digest of the command."""
    digest = hashlib.blake2b(command.encode(), digest_size=4).hexdigest()
    return f"{args.model}-{args.seq_len}-{args.gpus}-{digest}"


def dry_run(store: Path, name: str, command: str) -> None:
    """Run ``command --dry-run --json`` and keep its JSON line as ``NAME.json`` (its text as ``NAME.out``)."""
    words = command.split()[1:]  # drop "burstattn": run this checkout's CLI
    res = subprocess.run([sys.executable, "-m", "burstattn.cli", *words, "--dry-run", "--json"], capture_output=True,
                         text=True, check=False)
    (store / f"{name}.cmd").write_text(command + "\n")
    (store / f"{name}.out").write_text(res.stdout + res.stderr[-4000:])
    if res.returncode == 0:
        (store / f"{name}.json").write_text(res.stdout.strip().splitlines()[-1] + "\n")


def rows_md(args, store: Path) -> list[str]:
    """The markdown rows: strategy, degrees and options, predicted and dry-run GiB by term, and the error."""
    from burstattn.cli.verify import TERMS, compare

    lines = []
    for label, r in best_rows(args).items():
        cmd = r["config"]["train"]
        path = store / f"{name_of(args, cmd)}.json"
        d = r["degrees"]
        what = (f"{label} | {d['dp']}/{d['cp']}/{d['tp']} | {r['checkpointing']}, chunks {r['mlp_chunk']}/"
                f"{r['loss_chunk']}, offload {r['offload']}" + (", fused loss" if "--fused-loss" in cmd else ""))
        if not path.exists():
            lines.append(f"| {what} | {r['peak_memory_bytes'] / GIB:.2f} | not run | | |")
            continue
        dry = json.loads(path.read_text())
        c = compare(r["peak_by_term"], r["peak_memory_bytes"], dry, r.get("capacity_bytes"))
        terms = " ".join(f"{c['predicted_by_term'][t] / GIB:.1f}/{c['dry_run_by_term'][t] / GIB:.1f}" for t in TERMS)
        lines.append(f"| {what} | {c['predicted_peak_bytes'] / GIB:.2f} | {c['dry_run_peak_bytes'] / GIB:.2f} | "
                     f"{c['error']:+.1%} | {terms} |")
    return lines


def stored_row(store: Path, name: str) -> str:
    """The markdown row of a stored dry run of any ``burstattn train`` command (``NAME.cmd``), against the
    memory model of the same configuration (``sim.step.memory_model``: what the planner computes for it)."""
    from burstattn.cli.verify import TERMS, command_model, compare

    cfg, _, mem = command_model((store / f"{name}.cmd").read_text().strip())
    c = compare(mem.by_term(), mem.peak, json.loads((store / f"{name}.json").read_text()), mem.capacity)
    terms = " ".join(f"{c['predicted_by_term'][t] / GIB:.1f}/{c['dry_run_by_term'][t] / GIB:.1f}" for t in TERMS)
    what = (f"{cfg.strategy}{'(' + cfg.schedule + ')' if cfg.schedule != 'ring' else ''} | {cfg.dp or 1}/{cfg.cp}/"
            f"{cfg.tp} | {cfg.checkpointing}, chunks {cfg.mlp_chunk}/{cfg.loss_chunk}, offload {cfg.offload}"
            + (", fused loss" if cfg.fused_loss else ""))
    return (f"| {what} | {c['predicted_peak_bytes'] / GIB:.2f} | {c['dry_run_peak_bytes'] / GIB:.2f} | "
            f"{c['error']:+.1%} | {terms} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--cluster", default="h100-nvlink-ib")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--store", default="bench/results/verify")
    p.add_argument("--commands", action="store_true", help="print NAME and command per strategy")
    p.add_argument("--run", metavar="NAME", help="dry-run the stored plan NAME")
    p.add_argument("--stored", metavar="NAME", help="the row of a stored dry run of any command (NAME.cmd)")
    args = p.parse_args()
    store = Path(args.store)
    if args.stored:
        print(stored_row(store, args.stored))
        return 0
    store.mkdir(parents=True, exist_ok=True)
    plans = {name_of(args, r["config"]["train"]): (label, r["config"]["train"]) for label, r in best_rows(args).items()}
    if args.commands:
        for name, (label, cmd) in plans.items():
            print(f"{name}\t{label}\t{cmd}")
        return 0
    if args.run:
        dry_run(store, args.run, plans[args.run][1])
        return 0
    print("\n".join(rows_md(args, store)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

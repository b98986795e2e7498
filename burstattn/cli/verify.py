"""``burstattn plan --verify [K]``: dry-run the K best plans and set the simulator's predicted peak
beside the dry run's, term by term.

The plan's own ``burstattn train`` command (:func:`burstattn.sim.planner.configuration`) is parsed by
``train``'s own parser, so the dry run runs exactly the configuration the planner tells a user to run.
The pure parts (:func:`train_config`, :func:`command_model`, :func:`compare`) take no process group and are unit-tested.
"""
from __future__ import annotations

import argparse
import shlex
from typing import Optional

TERMS = ("parameters", "gradients", "optimizer", "activations", "temporaries")


def train_config(command: str):
    """``(TrainConfig, world_size)`` of a ``burstattn train ...`` command line, through ``train``'s parser."""
    from . import train

    words = shlex.split(command)
    if words[:2] != ["burstattn", "train"]:
        raise ValueError(f"not a `burstattn train` command: {command!r}")
    parser = argparse.ArgumentParser(prog="burstattn")
    train.add(parser.add_subparsers(dest="command"))
    ns = parser.parse_args(words[1:])
    return train.config_of(ns), ns.world_size or 1


def command_model(command: str):
    """``(TrainConfig, world_size, MemoryModel)`` of a ``burstattn train ...`` command: the simulator's
    memory model of exactly that configuration (what the planner computes for it; ``.peak``, ``.by_term()``)."""
    from ..sim.from_train import sim_config
    from ..sim.step import memory_model

    cfg, world = train_config(command)
    return cfg, world, memory_model(sim_config(cfg, world))


def compare(predicted: dict, predicted_peak: float, dry: dict, capacity: Optional[float]) -> dict:
    """One verified plan: the predicted and dry-run peaks (bytes per rank), by term (:data:`TERMS`),
    the relative error of the total, and whether the dry run fits ``capacity`` (``None``: unknown), with
    the dry run's largest term (``binds``) when it does not."""
    by_cat = dry["peak_by_category"]
    out = {"predicted_peak_bytes": int(predicted_peak), "dry_run_peak_bytes": int(dry["peak_bytes"]),
           "predicted_by_term": {k: int(predicted.get(k, 0)) for k in TERMS},
           "dry_run_by_term": {k: int(by_cat.get(k, 0)) for k in TERMS}}
    out["error"] = (out["predicted_peak_bytes"] - out["dry_run_peak_bytes"]) / max(out["dry_run_peak_bytes"], 1)
    out["dry_run_fits"] = None if capacity is None else out["dry_run_peak_bytes"] <= capacity
    out["binds"] = max(TERMS, key=lambda k: out["dry_run_by_term"][k]) if out["dry_run_fits"] is False else None
    return out


def verify_rows(rows: list[dict], k: int, capacity: Optional[float]) -> list[dict]:
    """Dry-run (rank 0) the first ``k`` plan rows that carry a ``burstattn train`` command; each row
    gets the fields of :func:`compare` plus ``dry_run_seconds``.
    A plan the fake mode cannot follow keeps its row with ``dry_run_peak_bytes: None`` and the
    one-line ``dry_run_error``."""
    from ..train.dryrun import DryRunError, dry_run

    out = []
    for row in [r for r in rows if "train" in r.get("config", {})][:k]:
        cfg, world = train_config(row["config"]["train"])
        try:
            dry = dry_run(cfg, world, 0)
        except DryRunError as exc:
            out.append({**row, "predicted_peak_bytes": int(row["peak_memory_bytes"]), "dry_run_peak_bytes": None,
                        "dry_run_error": str(exc)})
            continue
        out.append({**row, **compare(row["peak_by_term"], row["peak_memory_bytes"], dry, capacity),
                    "dry_run_seconds": dry["seconds"]})
    return out


def _mib(n: float) -> str:
    return f"{n / 2**20:10.1f}"


def format_verified(rows: list[dict]) -> str:
    """The printed comparison: per plan, predicted and dry-run MiB by term and the total's error."""
    lines = []
    for i, r in enumerate(rows):
        d = r["degrees"]
        if r["dry_run_peak_bytes"] is None:
            lines.append(f"{i + 1}. {r['strategy']} dp={d['dp']} cp={d['cp']} tp={d['tp']}: predicted "
                         f"{_mib(r['predicted_peak_bytes']).strip()} MiB, no dry run: {r['dry_run_error']}")
            continue
        fit = {None: "", True: "fits", False: f"DOES NOT FIT (binds: {r['binds']})"}[r["dry_run_fits"]]
        lines.append(f"{i + 1}. {r['strategy']} dp={d['dp']} cp={d['cp']} tp={d['tp']} {r['checkpointing']} "
                     f"chunks {r['mlp_chunk']}/{r['loss_chunk']} offload {r['offload']}: predicted "
                     f"{_mib(r['predicted_peak_bytes']).strip()} MiB, dry run {_mib(r['dry_run_peak_bytes']).strip()}"
                     f" MiB ({r['error']:+.1%}) {fit}")
        lines.append(f"   {'MiB':12s} {'predicted':>10s} {'dry run':>10s}")
        for t in TERMS:
            lines.append(f"   {t:12s} {_mib(r['predicted_by_term'][t])} {_mib(r['dry_run_by_term'][t])}")
    return "\n".join(lines)


def max_len_rows(res: dict, k: int, ranking) -> list[dict]:
    """The plan rows of the ``k`` longest ``--max-seq-len`` answers: ``ranking(tokens)`` is the
    planner's ranking at that length; the row of the same strategy label and degrees is taken."""
    rows = []
    for label, v in sorted(res.items(), key=lambda kv: -kv[1]["tokens"])[:k]:
        if v["tokens"] <= 0:
            continue
        match = [r for r in ranking(v["tokens"]) if r["strategy"] == label and r["degrees"] == v["degrees"]]
        rows += match[:1]
    return rows

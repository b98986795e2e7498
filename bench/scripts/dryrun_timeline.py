"""The dry run's memory over one training step, stacked by category, beside the planner's prediction.

    python -m bench.scripts.dryrun_timeline --seq-len 1048576 --world-size 32 --out docs/img/dryrun-timeline.png

Runs :func:`burstattn.train.dryrun.dry_run` (rank 0, fake tensors, PyTorch's memory trackers) with its
timeline, and the simulator's memory model of the same configuration
(:func:`burstattn.sim.from_train.sim_config`, ``Memory.by_term``). Writes the PNG and the report as JSON
(``--json``, in bench/results/: the dry run without the timeline, the prediction by term). Needs matplotlib.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

GIB = 2**30
COLORS = {"parameters": "#4c72b0", "gradients": "#dd8452", "optimizer": "#55a868", "activations": "#c44e52",
          "temporaries": "#8172b3"}


def run(seq_len: int, world: int, model: str, extra: dict) -> tuple[dict, dict, float]:
    """``(dry-run report with timeline, predicted bytes by term, predicted peak)``."""
    from burstattn.sim.from_train import sim_config
    from burstattn.sim.step import simulate
    from burstattn.train import TrainConfig
    from burstattn.train.dryrun import dry_run

    cfg = TrainConfig(model=model, seq_len=seq_len, batch=1, steps=1, dtype="bfloat16", **extra)
    report = dry_run(cfg, world, 0, timeline=True)
    mem = simulate(sim_config(cfg, world), memory_only=True).memory
    return report, mem.by_term(), float(mem.peak)


def plot(report: dict, predicted: dict, predicted_peak: float, out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = report["timeline"]
    cats, points = tl["categories"], tl["points"]
    xs = [p[0] for p in points]
    ys = [[p[2][i] / GIB for p in points] for i in range(len(cats))]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [5, 1]}, sharey=True)
    ax.stackplot(xs, ys, labels=cats, colors=[COLORS[c] for c in cats], step="post")
    first = {}
    for op, phase, _ in points:
        first.setdefault(phase, op)
    for phase, op in first.items():
        ax.axvline(op, color="k", lw=0.6, ls=":")
        ax.text(op, ax.get_ylim()[1] * 0.97, f" {phase}", fontsize=8, va="top")
    ax.set_xlabel("ops of the step (the dry run's timeline)")
    ax.set_ylabel("GiB on rank 0")
    ax.set_title(title, fontsize=9)
    ax.legend(loc="upper left", fontsize=8, ncol=2)
    bottom = 0.0
    for name in ("dry run", "planner"):
        split = report["peak_by_category"] if name == "dry run" else predicted
        x = 0 if name == "dry run" else 1
        bottom = 0.0
        for c in cats:
            bx.bar(x, split[c] / GIB, bottom=bottom, color=COLORS[c], width=0.7)
            bottom += split[c] / GIB
        bx.text(x, bottom, f"{bottom:.1f}", ha="center", va="bottom", fontsize=8)
    bx.set_xticks([0, 1], ["dry-run\npeak", "planner"])
    bx.set_title(f"peak: {report['peak_bytes'] / GIB:.1f} vs {predicted_peak / GIB:.1f} GiB", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--seq-len", type=int, default=1048576)
    ap.add_argument("--world-size", type=int, default=32)
    ap.add_argument("--checkpointing", default="remat")
    ap.add_argument("--mlp-chunk", type=int, default=4096)
    ap.add_argument("--loss-chunk", type=int, default=256)
    ap.add_argument("--no-fsdp", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("docs/img/dryrun-timeline.png"))
    ap.add_argument("--json", type=Path, default=Path("bench/results/dryrun-timeline.json"), help="the report")
    ns = ap.parse_args()
    extra = dict(checkpointing=ns.checkpointing, mlp_chunk=ns.mlp_chunk, loss_chunk=ns.loss_chunk, fsdp=not ns.no_fsdp)
    report, predicted, peak = run(ns.seq_len, ns.world_size, ns.model, extra)
    title = (f"{ns.model}, {ns.seq_len:,} tokens over {ns.world_size} ranks, burst, {ns.checkpointing}, chunks "
             f"{ns.mlp_chunk}/{ns.loss_chunk}{'' if ns.no_fsdp else ', FSDP2'}, bf16 (dry run {report['seconds']:.0f} s)")
    plot(report, predicted, peak, ns.out, title)
    slim = {k: v for k, v in report.items() if k != "timeline"}
    ns.json.write_text(json.dumps(dict(dry_run=slim, predicted_by_term=predicted,
                                                           predicted_peak_bytes=peak), indent=1))
    print(json.dumps(dict(peak=report["peak_bytes"] / GIB, predicted=peak / GIB, seconds=report["seconds"],
                          ops=report["ops"], points=len(report["timeline"]["points"]))))


if __name__ == "__main__":
    main()

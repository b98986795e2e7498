"""PNG plots of ``burstattn bench grid`` records: time, peak memory and bytes per rank vs sequence length.

One figure per (quantity, causal), one line per contender that ran correctly (wrong ones are drawn
dashed and labelled WRONG). matplotlib is imported only inside :func:`plot_grid` (``pip install
burstattn[bench]``), with the non-interactive Agg backend.
"""
from __future__ import annotations

from pathlib import Path

__all__ = ["plot_grid", "QUANTITIES"]

QUANTITIES = {  # key -> (y label, value of a record)
    "time": ("fwd+bwd time, median (s)", lambda r: r["median_s"]["fwd+bwd"]),
    "memory": ("peak memory per rank, fwd+bwd (MiB)", lambda r: r["peak_bytes"]["fwd+bwd"] / 2**20),
    "bytes": ("bytes sent per rank, fwd+bwd (MiB)", lambda r: r["sent_bytes"]["fwd+bwd"] / 2**20),
}


def plot_grid(records: list[dict], out_dir: str | Path, *, stem: str = "grid") -> list[Path]:
    """Write ``<stem>-<quantity>-<causal|noncausal>.png`` under ``out_dir``; return the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.report import correct

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    done = [r for r in records if "median_s" in r]
    paths = []
    for causal in sorted({r["config"]["causal"] for r in done}):
        subset = [r for r in done if r["config"]["causal"] == causal]
        names = list(dict.fromkeys(r.get("name", r["contender"]) for r in subset))
        for key, (label, value) in QUANTITIES.items():
            fig, ax = plt.subplots(figsize=(7.5, 4.8))
            for i, name in enumerate(names):
                pts = sorted((r["config"]["seq_len"], value(r), correct(r))
                             for r in subset if r.get("name", r["contender"]) == name)
                ok = all(c for _, _, c in pts)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="osv^D<>ph*"[i % 10],
                        color="black" if name == "burst" else plt.cm.tab20(i % 20),
                        linestyle="-" if ok else "--", linewidth=2.5 if name == "burst" else 1.2,
                        label=name if ok else f"{name} (WRONG)")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")  # rsa is 10x the others: keep the rest readable
            ax.set_xlabel("sequence length N")
            ax.set_ylabel(label)
            world = subset[0]["world_size"]
            ax.set_title(f"{label.split(',')[0]} - P={world}, {'causal' if causal else 'non-causal'}")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7, ncol=2)
            fig.tight_layout()
            path = out_dir / f"{stem}-{key}-{'causal' if causal else 'noncausal'}.png"
            fig.savefig(path, dpi=90)
            plt.close(fig)
            paths.append(path)
    return paths

"""Markdown tables and PNG plots of ``burstattn bench train`` (matplotlib imported lazily)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional


def _name(r: dict) -> str:
    return r["strategy"] + ("+fsdp" if r["fsdp"] else "")


def _find(recs: list[dict], **want) -> Optional[dict]:
    for r in recs:
        if "error" not in r and all(r.get(k) == v for k, v in want.items()):
            return r
    return None


def _mib(r: dict) -> str:
    return f"{max(r['peak_bytes_per_rank']) / 2**20:.0f}"


def markdown(doc: dict) -> str:
    """The sweep table (tokens/s and peak MiB per rank by length), the ratios the issue asks for and
    the checkpointing-mode table."""
    recs = doc["records"]
    sweep = [r for r in recs if r["suite"] == "sweep"]
    lens = sorted({r["seq_len"] for r in sweep})
    names = list(dict.fromkeys(_name(r) for r in sweep))
    cfg = doc["config"]
    lines = []
    if doc.get("spec"):
        sp, links = doc["spec"], doc["links"]
        lines += [f"Emulated cluster `{doc.get('cluster')}`: {sp['nodes']} nodes x {sp['ranks_per_node']} ranks, "
                  f"inter-node link {links['inter']}, intra-node {links['intra']} (scaled to this machine's "
                  f"{doc['local_flops'] / 1e9:.1f} GFLOP/s per rank).", ""]
    lines += [f"Model `{cfg['model']}`, batch {cfg['batch']}, {cfg['world_size']} ranks x {cfg['threads']} thread(s), "
             f"median of {cfg['repeats']} steps after {cfg['warmup']} warm-up; peak = most bytes held by PyTorch's "
             "allocator during one step, max over ranks."]
    if lens:
        lines += ["", "| contender | " + " | ".join(f"N={n} tok/s | MiB" for n in lens) + " |",
                  "|---|" + "---:|---:|" * len(lens)]
    for name in names:
        cells = []
        for n in lens:
            r = next((x for x in sweep if _name(x) == name and x["seq_len"] == n), None)
            cells += ["error", "-"] if r is None or "error" in r else [f"{r['tokens_per_s']:.0f}", _mib(r)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    longest = max(lens) if lens else None
    burst, v3 = _find(sweep, strategy="burst", fsdp=False, seq_len=longest), _find(sweep, strategy="tp-v3", fsdp=False,
                                                                                 seq_len=longest)
    burst_fsdp = _find(sweep, strategy="burst", fsdp=True, seq_len=longest)
    lines.append("")
    if burst and v3:
        lines.append(f"At N={longest}: burst / tp-v3 tokens/s = {burst['tokens_per_s'] / v3['tokens_per_s']:.2f}x; ")
    if burst_fsdp and v3:
        lines[-1] += (f"burst+fsdp / tp-v3 peak memory per rank = "
                      f"{max(burst_fsdp['peak_bytes_per_rank']) / max(v3['peak_bytes_per_rank']):.2f}x.")
    modes = [r for r in recs if r["suite"] == "modes"]
    if modes:
        lines += ["", f"Checkpointing modes at N={modes[0]['seq_len']}:", "",
                  "| contender | mode | tok/s | step s | peak MiB/rank |", "|---|---|---:|---:|---:|"]
        for r in modes:
            if "error" in r:
                lines.append(f"| {r['strategy']} | {r['checkpointing']} | error | | |")
                continue
            lines.append(f"| {r['strategy']} | {r['checkpointing']} | {r['tokens_per_s']:.0f} | {r['median_s']:.2f} | "
                         f"{_mib(r)} |")
        for s in dict.fromkeys(r["strategy"] for r in modes):
            full, remat = _find(modes, strategy=s, checkpointing="full"), _find(modes, strategy=s, checkpointing="remat")
            if full and remat:
                lines.append(f"\n{s}: remat / full tokens/s = {remat['tokens_per_s'] / full['tokens_per_s']:.2f}x")
    load = doc.get("other_load")
    if load:
        lines += ["", f"Other processes' CPU load during the run: {json.dumps(load)}"]
    return "\n".join(lines) + "\n"


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_sweep(records: list[dict], out_dir: str | Path, prefix: str = "train") -> list[Path]:
    """``PREFIX-tokens_per_s.png`` and ``PREFIX-memory.png`` against sequence length."""
    plt = _plt()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sweep = [r for r in records if r["suite"] == "sweep" and "error" not in r]
    paths = []
    for key, label, value in (("tokens_per_s", "tokens/s (median step)", lambda r: r["tokens_per_s"]),
                              ("memory", "peak memory per rank (MiB)", lambda r: max(r["peak_bytes_per_rank"]) / 2**20)):
        fig, ax = plt.subplots(figsize=(7.5, 4.8))
        for i, name in enumerate(dict.fromkeys(_name(r) for r in sweep)):
            pts = sorted((r["seq_len"], value(r)) for r in sweep if _name(r) == name)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="osv^D<>ph*"[i % 10],
                    linestyle="--" if name.endswith("+fsdp") else "-",
                    color="black" if name.startswith("burst") else plt.cm.tab10(i // 2 % 10),
                    linewidth=2.2 if name.startswith("burst") else 1.2, label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length N")
        ax.set_ylabel(label)
        world = sweep[0]["world_size"] if sweep else "?"
        ax.set_title(f"training steps, {sweep[0]['model'] if sweep else ''} model, P={world}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        path = out_dir / f"{prefix}-{key}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)
    return paths


def plot_curve(metrics: str | Path, out_dir: str | Path, smooth: int = 20, name: str = "train-curve") -> list[Path]:
    """``NAME.png``: loss and passkey accuracy (moving average of ``smooth`` steps) of a
    ``burstattn train --metrics`` file."""
    plt = _plt()
    rows = [json.loads(x) for x in Path(metrics).read_text().splitlines() if x.strip()]
    steps = [r["step"] for r in rows]

    def avg(xs):
        return [sum(xs[max(0, i - smooth + 1):i + 1]) / len(xs[max(0, i - smooth + 1):i + 1]) for i in range(len(xs))]

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    ax.plot(steps, [r["loss"] for r in rows], color="tab:blue", alpha=0.3)
    ax.plot(steps, avg([r["loss"] for r in rows]), color="tab:blue", label="loss")
    if rows and rows[0].get("answer_loss") is not None:
        ax.plot(steps, avg([r["answer_loss"] for r in rows]), color="tab:green", label="loss on the key digits")
        ax.axhline(2.302585, color="tab:green", linestyle=":", linewidth=1, label="ln 10 (guessing a digit)")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("next-token loss (nats)")
    if rows and rows[0].get("accuracy") is not None:
        ax2 = ax.twinx()
        ax2.plot(steps, avg([r["accuracy"] for r in rows]), color="tab:red", label=f"passkey accuracy ({smooth}-step mean)")
        ax2.set_ylim(0, 1)
        ax2.set_ylabel("passkey digit accuracy")
        ax2.legend(loc="center right", fontsize=8)
    ax.legend(loc="upper right", fontsize=8)
    r0 = rows[0] if rows else {}
    scored = {"answer": ", only the key digits scored", "all": ", every token scored"}.get(r0.get("targets"), "")
    ax.set_title(f"passkey task: {r0.get('strategy', '')}, world {r0.get('world_size', '?')}{scored}")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return [path]

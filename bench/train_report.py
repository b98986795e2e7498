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


def maxlen_markdown(doc: dict) -> str:
    """The longest-context table (with bytes per local token beside the floor), the timing ratios."""
    cfg, fl = doc["config"], doc.get("floor")
    lines = [f"Model `{cfg['model']}`, {cfg['world_size']} ranks x {cfg['threads']} thread(s), budget "
             f"{cfg['budget_mb']:g} MiB per rank (allocator peak of one steady-state step, max over ranks); "
             f"blockwise = MLP chunk {cfg['mlp_chunk']}, loss chunk {cfg['loss_chunk']} tokens.", "",
             "| contender | longest N | peak MiB/rank | resident MiB/rank | bytes/local token | slope B/token | "
             "x floor | step s |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    floor = fl["per_token"] if fl else None
    flat = []
    for r in doc["records"]:
        top = max((p for p in r["probes"] if p["fits"]), key=lambda p: p["seq_len"], default=None)
        if top is None:
            lines.append(f"| {r['contender']} | - | | | | | | | {r.get('note') or ''}")
            continue
        bpt = r["bytes_per_token"]
        own = (fl.get("per_contender") or {}).get(r["contender"], floor) if fl else None
        ratio = f"{bpt['at_longest'] / own:.2f}" if own else ""
        if own and bpt.get("slope") is not None and bpt["slope"] < own / 2:
            ratio = "-"  # the peak did not grow with the length: fixed terms set it (floor_note)
            flat.append(f"{r['contender']} ({bpt['slope']:,.0f} B/token)")
        lines.append(f"| {r['contender']} | {r['longest']:,} | {max(top['peak_bytes']) / 2**20:.0f} | "
                     f"{max(top['maxrss_bytes']) / 2**20:.0f} | {bpt['at_longest']:,.0f} | "
                     f"{bpt.get('slope', float('nan')):,.0f} | {ratio} | {top['seconds']:.1f} |"
                     + (f" {r['note']}" if r.get("note") else ""))
    if flat:
        lines += ["", f"x floor left out for {', '.join(flat)}: the step's peak hardly grew between the two longest "
                      "fits, so fixed terms (the optimizer step, the loss) set it, not what each token holds; peak less "
                      "all gradients then undercounts the activations. Raise --budget-mb to compare with the floor."]
    by = {r["contender"]: r["longest"] or 0 for r in doc["records"]}
    for base, what in (("remat-qkv", "the remat before the lean one"), ("remat", "the lean remat without chunks")):
        if by.get(base) and by.get("remat+blockwise"):
            lines += ["", f"remat+blockwise / {base} ({what}) longest context: "
                          f"{by['remat+blockwise'] / by[base]:.2f}x."]
    if fl:
        lines += ["", f"Floor at N={fl['seq_len']:,}: saved tensors {fl['saved_per_token']:,.0f} B/token (layers x (input "
                      f"+ attention output + LSE)) + the attention call alone {fl['attention_call_per_token']:,.0f} "
                      f"B/token = {fl['per_token']:,.0f} B per local token."]
    t = doc.get("timing")
    if t:
        c = t["contenders"]
        lines += ["", f"Step time side by side at N={t['seq_len']:,} (median of {cfg['repeats']}):", "",
                  "| contender | median s | samples |", "|---|---:|---|"]
        lines += [f"| {k} | {v['median_s']:.2f} | {' '.join(f'{s:.2f}' for s in v['samples'])} |" for k, v in c.items()]
        for a, b, what in (("remat+blockwise", "remat", "blockwise MLP + loss under remat"),
                           ("none+blockwise", "none", "blockwise MLP + loss without checkpointing"),
                           ("remat", "remat-qkv", "lean remat vs the remat keeping q, k, v")):
            if a in c and b in c:
                lines.append(f"\n{what}: {c[a]['median_s'] / c[b]['median_s']:.3f}x the step time")
    load = doc.get("other_load")
    if load:
        lines += ["", f"Other processes' CPU load during the run: {json.dumps(load)}"]
    return "\n".join(lines) + "\n"


def plot_maxlen(doc: dict, out_dir: str | Path) -> Path:
    """``train-maxlen.png``: the longest context per contender and its bytes per local token beside the floor."""
    plt = _plt()
    recs = [r for r in doc["records"]]
    names = [r["contender"] for r in recs]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.6))
    longest = [r["longest"] or 0 for r in recs]
    colors = ["black" if "blockwise" in n else "tab:gray" for n in names]
    ax1.barh(names, longest, color=colors)
    for i, v in enumerate(longest):
        ax1.text(v, i, f" {v:,}", va="center", fontsize=8)
    ax1.set_xlabel("longest --seq-len that fits (tokens)")
    ax1.set_title(f"{doc['config']['model']}, P={doc['config']['world_size']}, {doc['config']['budget_mb']:g} MiB/rank")
    ax1.invert_yaxis()
    per = [r["bytes_per_token"].get("at_longest", 0) / 1024 for r in recs]
    ax2.barh(names, per, color=colors)
    fl = doc.get("floor")
    if fl:
        ax2.axvline(fl["per_token"] / 1024, color="tab:red", linestyle="--", label="floor (saved + attention call)")
        ax2.axvline(fl["saved_per_token"] / 1024, color="tab:orange", linestyle=":", label="saved tensors alone")
        ax2.legend(fontsize=7)
    ax2.set_xscale("log")
    ax2.set_xlabel("peak bytes per local token at the longest fit (KiB)")
    ax2.invert_yaxis()
    ax2.set_yticklabels([])
    fig.tight_layout()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "train-maxlen.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path

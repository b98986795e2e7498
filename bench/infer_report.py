"""Markdown tables and PNG plots of a ``burstattn bench infer`` document (:mod:`.infer`)."""
from __future__ import annotations

from pathlib import Path


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def _prefill(doc: dict) -> list[str]:
    recs = doc["prefill"]
    if not recs:
        return []
    names = list(dict.fromkeys(r["strategy"] for r in recs))
    lens = sorted({r["prompt_len"] for r in recs})
    at = {(r["strategy"], r["prompt_len"]): r for r in recs}
    rows = [[str(n)] + [f"{at[(s, n)]['median_s']:.3f}" if (s, n) in at else "-" for s in names] for n in lens]
    longest = lens[-1]
    single = at.get(("single process", longest))
    p = doc["config"]["world_size"]
    out = [f"## First-token latency (s) against prompt length, {doc['config']['model']} model, P={p}", "",
           "Wall time from a barrier to the first token (sharded prefill), median, max over ranks; "
           "'single process' holds the whole prompt.", ""] + _table(["prompt"] + names, rows) + [""]
    if single:
        ratios = ", ".join(f"{s} {single['median_s'] / at[(s, longest)]['median_s']:.2f}x"
                           for s in names if s != "single process" and (s, longest) in at)
        out += [f"Speedup over one process at {longest} tokens: {ratios}.", ""]
    return out


def _decode(doc: dict) -> list[str]:
    d = doc["decode"]
    if not d:
        return []
    sharded, single = d["sharded"], d["single"][0]
    step = max(r["median_s"] for r in sharded)
    cfg = doc["config"]
    rows = [[f"sharded, P={len(sharded)}", f"{1 / step:.1f}", f"{step * 1e3:.2f}",
             str(sharded[0]["bytes_per_token"]), str(max(r["cache_bytes"] for r in sharded))],
            ["one process", f"{1 / single['median_s']:.1f}", f"{single['median_s'] * 1e3:.2f}", "0",
             str(single["cache_bytes"])]]
    return [f"## Decoding over a {cfg['decode_cache']}-token cache, {cfg['model']} model", "",
            f"Median of {cfg['decode_tokens']} decode steps; bytes sent per token and rank (all layers, the "
            "byte meter); K/V bytes held per rank.", ""] + \
        _table(["", "tokens/s", "ms / token", "bytes / token", "K/V per rank (bytes)"], rows) + [""]


def _crossover(doc: dict) -> list[str]:
    recs = doc["crossover"]
    if not recs:
        return []
    cfg = doc["config"]
    rows = []
    for r in recs:
        t = r["median_s"]
        faster = "kv" if t["kv"] < t["q"] else "q"
        rows.append([str(r["new_tokens"]), f"{t['kv']:.4f}", f"{t['q']:.4f}", str(r["sent_bytes"]["kv"]),
                     str(r["sent_bytes"]["q"]), r["formula_choice"], faster])
    agree = sum(r[-1] == r[-2] for r in rows)
    return [f"## Continuation: pass-KV against pass-Q, {cfg['crossover_cache']} cached tokens, "
            f"{cfg['model']} shape with one kv head, P={cfg['world_size']}", "",
            "A second prompt of M tokens appended to the sharded cache; time to its first token (median, "
            "max over ranks, the two modes interleaved); bytes sent per rank (measured, = the formula).", ""] + \
        _table(["M", "pass-KV (s)", "pass-Q (s)", "bytes KV", "bytes Q", "formula picks", "faster"], rows) + \
        ["", f"The formula's choice matched the faster mode at {agree} of {len(rows)} sizes.", ""]


def cluster_markdown(res: dict, model: str) -> str:
    """The first-token latency table of an emulated-cluster run (:mod:`bench.cluster.infer_bench`)."""
    recs = res["rows"]
    names = list(dict.fromkeys(r["strategy"] for r in recs))
    lens = sorted({r["prompt_len"] for r in recs})
    at = {(r["strategy"], r["prompt_len"]): r for r in recs}
    spec = res["spec"]
    rows = [[str(n)] + [f"{at[(s, n)]['median_s']:.3f}" for s in names] for n in lens]
    mib = [[str(n)] + [f"{at[(s, n)]['sent_bytes'] / 2**20:.1f}" for s in names] for n in lens]
    return "\n".join([f"## First-token latency (s) on the emulated {spec.get('name') or 'custom'} cluster, "
                      f"{model} model, {spec['nodes']} nodes x {spec['ranks_per_node']} ranks", "",
                      f"Run on {res['date']} ({res['wall_s']:.0f} s); links: inter {spec['inter']}, intra "
                      f"{spec['intra']}. Median, max over ranks.", ""] + _table(["prompt"] + names, rows)
                     + ["", "MiB sent per rank for the prefill:", ""] + _table(["prompt"] + names, mib) + [""])


def infer_markdown_crossover(res: dict, cfg) -> str:
    """The crossover table of an emulated-cluster run (``cfg``: the run's InferBenchConfig)."""
    doc = {"crossover": res["crossover"],
           "config": {"crossover_cache": cfg.crossover_cache, "model": cfg.model,
                      "world_size": res["spec"]["nodes"] * res["spec"]["ranks_per_node"]}}
    return "\n".join(_crossover(doc))


def infer_markdown(doc: dict) -> str:
    m = doc["machine"]
    head = ["# Inference benchmarks: `burstattn bench infer`", "",
            f"Generated on {doc['started']} ({doc['duration_s']:.0f} s). Machine: {m['cpu']}, {m['cores']} cores; "
            f"torch {m['torch']}; 1 thread per rank; load average (1 min) at start {m['load_avg_1m']}.", ""]
    return "\n".join(head + _prefill(doc) + _decode(doc) + _crossover(doc))


def plot_infer(doc: dict, out_dir: str | Path) -> list[Path]:
    """``infer-prefill.png`` (latency vs prompt length per strategy) and ``infer-crossover.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    if doc["prefill"]:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for name in dict.fromkeys(r["strategy"] for r in doc["prefill"]):
            pts = sorted((r["prompt_len"], r["median_s"]) for r in doc["prefill"] if r["strategy"] == name)
            ax.plot(*zip(*pts), marker="o", label=name, linestyle="--" if name == "single process" else "-")
        ax.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="first-token latency (s)",
               title=f"{doc['config']['model']}, P={doc['config']['world_size']}")
        ax.legend()
        paths.append(out_dir / "infer-prefill.png")
        fig.savefig(paths[-1], dpi=110, bbox_inches="tight")
        plt.close(fig)
    if doc["crossover"]:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        xs = [r["new_tokens"] for r in doc["crossover"]]
        for mode, label in (("kv", "pass-KV"), ("q", "pass-Q")):
            ax.plot(xs, [r["median_s"][mode] for r in doc["crossover"]], marker="o", label=f"{label} (time)")
        flips = [r["new_tokens"] for r in doc["crossover"] if r["formula_choice"] == "kv"]
        if flips:
            ax.axvline(min(flips), color="grey", linestyle=":", label="formula switches to pass-KV")
        ax.set(xscale="log", yscale="log", xlabel="new prompt tokens M", ylabel="time to first token (s)",
               title=f"continuation after {doc['config']['crossover_cache']} cached tokens")
        ax.legend()
        paths.append(out_dir / "infer-crossover.png")
        fig.savefig(paths[-1], dpi=110, bbox_inches="tight")
        plt.close(fig)
    return paths

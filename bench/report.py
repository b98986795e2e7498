"""Markdown for `burstattn bench` results: `core` (the generated part of ``bench/results/core.md``), `grid`
and `maxlen`."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from burstattn.engine.bytes import META_INTS

__all__ = ["write_markdown", "update_document", "GENERATED_END", "grid_markdown", "ratios_markdown",
           "maxlen_markdown", "correct", "TOLERANCE"]

GENERATED_END = "<!-- end of the generated part: text below this line is kept when the benchmark is re-run -->"


def seconds(x: float) -> str:
    return f"{x:.3f} s"


def _mib(x: float) -> str:
    return f"{x / 2**20:,.1f} MiB"


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def _verdict(rec: dict) -> str:
    if "met" not in rec:
        return "-"
    return "met" if rec["met"] else "**missed**"


def md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _overhead(recs: list[dict]) -> list[str]:
    rows = []
    for r in recs:
        m, o, o_min = r["median_s"], r["overhead"], r["overhead_of_min"]
        rows.append([r["name"], seconds(m["kernel fwd"]), seconds(m["library fwd"]), _pct(o["fwd"]),
                     seconds(m["kernel fwd+bwd"]), seconds(m["library fwd+bwd"]), _pct(o["fwd+bwd"]),
                     f"{_pct(o_min['fwd'])} / {_pct(o_min['fwd+bwd'])}", _layout(r), _verdict(r)])
    c = recs[0]["config"]
    return ["## Overhead at world size 1 (target: fwd+bwd within 5% of the kernel)", "",
            f"`burst_attn_func` in a 1-rank gloo group against `aten._scaled_dot_product_flash_attention_for_cpu` "
            f"(+ `_backward`) called directly on contiguous `[B, H, S, D]`; N={c['seq_len']}, "
            f"{c['heads']} heads, head_dim {c['head_dim']}, batch {c['batch']}, {c['dtype']}; "
            "calls alternated. \"vs the kernel on the caller's layout\": the same op on `[B, H, S, D]` views of "
            "the caller's `[B, S, H, D]` tensors (what plain SDPA on `q.transpose(1, 2)` runs): the call path's own "
            "cost, the layout's left out.", ""] \
        + md_table(["point", "kernel fwd", "library fwd", "overhead", "kernel fwd+bwd", "library fwd+bwd",
                  "overhead", "overhead of the fastest repeats (fwd / fwd+bwd)",
                  "vs the kernel on the caller's layout (fwd / fwd+bwd)", "target"], rows) + [""]


def _layout(r: dict) -> str:
    o = r.get("overhead_vs_layout")
    return "-" if o is None else f"{_pct(o['fwd'])} / {_pct(o['fwd+bwd'])}"


def _ceiling(recs: list[dict], base: dict[str, dict]) -> list[str]:
    out = []
    for r in recs:
        if "speedup_vs_kernel_1" not in r:  # without the overhead suite there is no 1-process kernel time
            continue
        m, s = r["median_s"], r["speedup_vs_kernel_1"]
        out.append(f"Machine ceiling ({r['name']}): each of 2 ranks runs the raw kernel on its half of the "
                   f"non-causal work (n local queries x all N keys) at the same time: fwd {seconds(m['kernel fwd'])} "
                   f"({s['fwd']:.2f}x the 1-process kernel), fwd+bwd {seconds(m['kernel fwd+bwd'])} "
                   f"({s['fwd+bwd']:.2f}x). No ring can beat this on this machine.")
    return out + [""] if out else []


def _speedup(recs: list[dict], base: dict[str, dict]) -> list[str]:
    rows = []
    for r in recs:
        m = r["median_s"]
        one = base.get("causal" if r["config"]["causal"] else "non-causal")
        if one is None or "speedup_vs_library_1" not in r:  # run without the overhead suite: no baseline
            rows.append([r["name"], "-", "-", seconds(m["library fwd"]), seconds(m["library fwd+bwd"]), "-", "-", "-",
                         "- (no world-1 baseline: run the overhead suite too)"])
            continue
        s_lib, s_ker = r["speedup_vs_library_1"], r["speedup_vs_kernel_1"]
        target = f">= {r['config']['target']}x: {_verdict(r)}" if r["config"]["target"] else "-"
        rows.append([r["name"], seconds(one["kernel fwd+bwd"]), seconds(one["library fwd+bwd"]), seconds(m["library fwd"]),
                     seconds(m["library fwd+bwd"]), f"{s_lib['fwd']:.2f}x", f"{s_lib['fwd+bwd']:.2f}x",
                     f"{s_ker['fwd+bwd']:.2f}x", target])
    c = recs[0]["config"]
    return ["## Parallel speedup: 2 ranks x 1 thread vs 1 process x 1 thread", "",
            f"Full sequence N={c['seq_len']}, {c['heads']} heads, head_dim {c['head_dim']}, batch {c['batch']}, "
            f"{c['dtype']}. Baselines: the library at world size 1 (\"1 proc\") and the raw kernel (\"kernel\"), "
            f"same process, same thread count. Time of a 2-rank repeat = its slowest rank.", ""] \
        + md_table(["point", "kernel fwd+bwd (1 proc)", "library fwd+bwd (1 proc)", "2 ranks fwd", "2 ranks fwd+bwd",
                  "speedup fwd", "speedup fwd+bwd", "fwd+bwd vs kernel", "target"], rows) + [""]


def _bytes(recs: list[dict]) -> list[str]:
    rows = []
    for r in recs:
        c, got, want = r["config"], r["sent_max"], r["expected"]
        fwd = lambda d: sum(v for k, v in d.items() if k.startswith("forward/"))  # noqa: E731
        bwd = lambda d: sum(v for k, v in d.items() if k.startswith("backward/"))  # noqa: E731
        ops = ", ".join(f"{k.split('/')[1]} {v:,}" for k, v in sorted(got.items()) if k.startswith("backward/"))
        rows.append([str(r["world_size"]), f"{c['heads']}/{c['kv_heads']}", c["dtype"],
                     f"{c['backward']} -> {r['backward_used']}", f"{fwd(got):,}", f"{fwd(want):,}",
                     f"{bwd(got):,}", f"{bwd(want):,}", ops, "yes" if r["match"] else "**no**"])
    c = recs[0]["config"]
    return ["## Bytes sent per rank: measured (`comm_stats`) vs `engine.bytes.ring_bytes`", "",
            f"One forward + backward, N={c['seq_len']}, head_dim {c['head_dim']}, batch {c['batch']}, "
            "causal zigzag. "
            f"Forward includes the {META_INTS * 8} bytes per peer of input validation (`meta`). "
            f"\"match\": every rank sent exactly the formula's bytes for every (phase, op).", ""] \
        + md_table(["P", "Hq/Hkv", "dtype", "backward (asked -> used)", "fwd sent", "fwd formula",
                  "bwd sent", "bwd formula", "bwd by op", "match"], rows) + [""]


def _memory(recs: list[dict]) -> list[str]:
    rows, prev = [], None
    for r in recs:
        peak = r["peak_bytes"]["fwd+bwd"]
        growth = f"{peak / prev[0]:.2f}x for {r['local_seq'] / prev[1]:.0f}x tokens" if prev else "-"
        rows.append([str(r["config"]["seq_len"]), str(r["local_seq"]), _mib(r["inputs_bytes"]),
                     _mib(r["peak_bytes"]["fwd"]), _mib(peak), f"{peak / r['local_seq'] / 1024:.1f} KiB", growth])
        prev = (peak, r["local_seq"])
    c = recs[0]["config"]
    return [f"## Peak memory per rank (measured), world size {recs[0]['world_size']}", "",
            f"Causal zigzag, {c['heads']} heads, head_dim {c['head_dim']}, {c['dtype']}, "
            f"backward {c['backward']}. "
            "Peak = most bytes held on top of what was allocated before the call (inputs q, k, v, grad_out "
            "not included; they are listed), from the PyTorch profiler's allocator events; max over ranks.", ""] \
        + md_table(["N", "local n", "inputs (q,k,v,dO)", "peak fwd", "peak fwd+bwd", "fwd+bwd per local token",
                  "growth"], rows) + [""]


def _partials(recs: list[dict]) -> list[str]:
    rows = []
    for r in recs:
        m, pk = r["median_s"], r["peak_bytes"]
        rows.append([r["name"], str(r["config"]["seq_len"]), seconds(m["kernel fwd+bwd"]), seconds(m["float32 fwd+bwd"]),
                     f"{r['time_ratio']:.2f}x", _mib(pk["kernel fwd+bwd"]), _mib(pk["float32 fwd+bwd"]),
                     f"{pk['float32 fwd+bwd'] / pk['kernel fwd+bwd']:.2f}x"])
    c = recs[0]["config"]
    return [f"## Float32 gradient partials: time and memory, world size {recs[0]['world_size']}", "",
            f"Causal zigzag, {c['dtype']}, head_dim {c['head_dim']}. `grad_partials=\"float32\"` (the default: "
            "each kernel backward runs on float32 copies of one 1024 x 1024 tile at a time, so no dQ/dK/dV partial "
            "is rounded to 16 bits before the float32 accumulation) against `grad_partials=\"kernel\"` (the "
            "kernel's own 16-bit partials), calls alternated in one spawn; peak per rank as in the memory table.",
            ""] + md_table(["heads", "N", "fwd+bwd kernel partials", "fwd+bwd float32 partials", "time",
                            "peak kernel partials", "peak float32 partials", "memory"], rows) + [""]


def write_markdown(doc: dict) -> str:
    """The Markdown report of a ``bench core`` JSON document (see :func:`bench.core.run_core`)."""
    m = doc["machine"]
    by = lambda s: [r for r in doc["records"] if r["suite"] == s]  # noqa: E731
    base = {r["name"]: r["median_s"] for r in by("overhead")}
    out = ["# Benchmarks: `burstattn bench core`", "",
           f"Generated by `burstattn bench core` on {doc['started']} ({doc['duration_s']:.0f} s). "
           f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB; {m['os']}; Python {m['python']}, "
           f"torch {m['torch']}. Threads: {doc['threads']}. "
           f"Load average (1 min) at start {m['load_avg_1m']}, at end {doc['load_avg_1m_end']:.2f}. "
           f"Medians of {doc['config']['repeats']} repeats after {doc['config']['warmup']} warm-up.", ""]
    code = doc.get("code")
    if code:
        out[-2] += (f" Code: commit `{code['commit']}`"
                    + (" with uncommitted changes to `burstattn/`." if code["dirty"] else "."))
    loads = {r["world_size"]: r.get("other_load_during_spawn") for r in doc["records"]}
    if any(loads.values()):
        out += ["Other processes on the machine during each spawn (average cores busy outside this benchmark; "
                "hypervisor steal): " + "; ".join(
                    f"world {w}: {x['other_cores']} cores, steal {x['steal_cores']} ({x['wall_s']:.0f} s)"
                    for w, x in sorted(loads.items()) if x) + ". Anything above ~0.05 means the timings "
                "shared the 2 cores with other work.", ""]
    if by("overhead"):
        out += _overhead(by("overhead"))
    if by("speedup"):
        out += _speedup(by("speedup"), base) + _ceiling(by("ceiling"), base)
    if by("bytes"):
        out += _bytes(by("bytes"))
    if by("memory"):
        out += _memory(by("memory"))
    if by("partials"):
        out += _partials(by("partials"))
    return "\n".join(out)


def update_document(path: str | Path, generated: str) -> None:
    """Write ``generated`` to ``path``, keeping what follows :data:`GENERATED_END` in the old file
    (the hand-written reading of the numbers)."""
    path = Path(path)
    kept = ""
    if path.exists():
        old = path.read_text()
        if GENERATED_END in old:
            kept = old.split(GENERATED_END, 1)[1]
    path.write_text(generated.rstrip("\n") + "\n\n" + GENERATED_END + (kept or "\n"))


# ------------------------------------------------------------------ bench grid / bench maxlen
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 5e-3}  # max rel error to count as correct


def correct(rec: dict) -> bool:
    """Whether a grid record's output and gradients are within :data:`TOLERANCE` of the float64 reference."""
    return "errors" in rec and max(rec["errors"].values()) <= TOLERANCE[rec["config"]["dtype"]]


def _row_name(r: dict) -> str:
    return r.get("name", r["contender"])


def _grid_rows(recs: list[dict], base: Optional[dict]) -> list[list[str]]:
    rows = []
    for r in recs:
        if "errors" not in r:
            why = r.get("unavailable") or r.get("failed", "?")
            rows.append([r["contender"], "n/a", why.splitlines()[-1][:160].replace("|", "/")] + [""] * 8)
            continue
        e, m = r["errors"], r["median_s"]
        ok = "yes" if correct(r) else "**WRONG**"
        vs = f"{m['fwd+bwd'] / base['median_s']['fwd+bwd']:.2f}x" if base and "median_s" in base else "-"
        f = r.get("formula_bytes")
        load = r.get("other_load") or {}
        rows.append([_row_name(r), ok, f"{e['out']:.1e} / {e['dq']:.1e} / {e['dk']:.1e} / {e['dv']:.1e}",
                     seconds(m["fwd"]), seconds(m["fwd+bwd"]), vs, _mib(r["peak_bytes"]["fwd+bwd"]),
                     _mib(r["sent_bytes"]["fwd+bwd"]), _mib(f["fwd+bwd"]) if f else "-",
                     ("yes" if r["comm_stats_agrees"] else "**no**") if "comm_stats_agrees" in r else "-",
                     f"{load.get('other_cores', '?')}"])
    return rows


def grid_markdown(doc: dict) -> str:
    """The Markdown report of a ``bench grid`` JSON document: one table per (world, dtype, N, causal)."""
    m, cfg = doc["machine"], doc["config"]
    out = [f"### `burstattn bench grid` ({doc['config']['name']})", "",
           f"Run {doc['started']} ({doc['duration_s']:.0f} s) on {m['cpu']}, {m['cores']} cores; torch {m['torch']}; "
           f"versions {doc['versions']}. Threads: {doc['threads']}. Heads {cfg['heads']} (kv {cfg['kv_heads']}), "
           f"head_dim {cfg['head_dim']}, batch {cfg['batch']}; median of {cfg['repeats']} repeats (a repeat = "
           f"slowest rank), after the byte/memory calls and {cfg['warmup']} more warm-up. Errors: max |x - ref| / "
           f"max |ref| of out / dQ / dK / dV vs float64 on a {cfg['check_seq_len']}-token instance of the same "
           f"config; correct = all <= {TOLERANCE}. Peak = allocator high-water mark of one fwd+bwd per rank "
           "(max over ranks, inputs excluded). Sent = bytes per rank of one fwd+bwd, measured by wrapping "
           "torch.distributed (max over ranks); formula = the strategy's/library's own count; comm_stats = "
           "burstattn's meter agrees with the wrapper. Load = other processes' cores during the point.", ""]
    groups: dict = {}
    for r in doc["records"]:
        c = r["config"]
        groups.setdefault((r["world_size"], c["dtype"], c["seq_len"], c["causal"]), []).append(r)
    for (world, dtype, seq, causal), recs in groups.items():
        base = next((r for r in recs if r["contender"] == "burst" and "median_s" in r), None)
        out += [f"#### P={world}, N={seq}, {'causal' if causal else 'non-causal'}, {dtype}", ""]
        out += md_table(["contender", "correct", "rel err out / dq / dk / dv", "fwd", "fwd+bwd", "fwd+bwd / burst",
                       "peak fwd+bwd", "sent fwd+bwd", "formula", "comm_stats", "load"],
                      _grid_rows(recs, base)) + [""]
    return "\n".join(out)


def maxlen_markdown(doc: dict) -> str:
    """The Markdown of a ``bench maxlen`` JSON document."""
    rows = [[r["contender"], f"{r['longest']:,}" if r.get("longest") else "-",
             _mib(r["peak_at_longest"]) if r.get("peak_at_longest") else "-",
             ", ".join(f"{n}: {_mib(b) if b is not None else 'fail'}" for n, b in r["probes"])
             + (f" ({r['note']})" if r.get("note") else "")] for r in doc["records"]]
    c = doc["config"]
    return "\n".join([f"### `burstattn bench maxlen`: longest sequence under {c['mem_budget_mib']} MiB per rank", "",
                      f"World {c['world_size']}, {c['heads']} heads, head_dim {c['head_dim']}, {c['dtype']}, "
                      f"{'causal' if c['causal'] else 'non-causal'}; measured peak of one fwd+bwd per rank "
                      "(inputs included), doubling then bisection to a multiple of "
                      f"{c['granule']} tokens.", ""]
                     + md_table(["contender", "longest N", "peak at longest", "probes (N: peak)"], rows) + [""])


def ratios_markdown(doc: dict, ours: str = "burst") -> str:
    """burst against every peer (contenders named ``peer:variant``), per shape: time, bytes and
    memory ratios (< 1: burst is lower) and whether each met the issue's target comparison."""
    by_shape: dict = {}
    for r in doc["records"]:
        c = r["config"]
        by_shape.setdefault((c["seq_len"], c["causal"], c["dtype"]), []).append(r)
    rows = []
    for (seq, causal, dtype), recs in sorted(by_shape.items()):
        base = next((r for r in recs if r["contender"] == ours and "median_s" in r), None)
        if base is None:
            continue
        for r in recs:
            if ":" not in r["contender"] or "median_s" not in r:
                continue
            t = base["median_s"]["fwd+bwd"] / r["median_s"]["fwd+bwd"]
            b = base["sent_bytes"]["fwd+bwd"] / r["sent_bytes"]["fwd+bwd"]
            m = base["peak_bytes"]["fwd+bwd"] / r["peak_bytes"]["fwd+bwd"]
            rows.append([str(seq), "causal" if causal else "non-causal", _row_name(r),
                         "yes" if correct(r) else "**WRONG**", f"{t:.3f}", f"{b:.2f}", f"{m:.2f}"])
    return "\n".join(md_table(["N", "mask", "peer", "peer correct", f"{ours} time / peer time (fwd+bwd)",
                             f"{ours} bytes / peer bytes", f"{ours} peak / peer peak"], rows)) + "\n"

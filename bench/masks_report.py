"""Records, ratios, verdicts and Markdown of ``burstattn bench masks`` (:mod:`.masks`), and the
section of ``bench/results/masks.md`` it rewrites (keeping that section's hand-written ``### Reading``)."""
from __future__ import annotations

import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import torch

from bench.mask_points import MaskPoint, packed_documents, point_layout, point_mask
from bench.report import TOLERANCE, md_table, seconds

__all__ = ["SECTION", "rank_costs", "useful_pairs", "combine", "derive", "masks_markdown", "update_section"]

SECTION = "## Masks and load balance: `burstattn bench masks`"


def rank_costs(p: MaskPoint, world: int) -> list[float]:
    """Score entries each rank computes in the forward under the plan the point runs (the engine's
    own plans, :func:`~burstattn.engine.plan.plan_cost`)."""
    from burstattn.engine.plan import plan_cost
    from burstattn.engine.run import build_plan
    from burstattn.masks import AttnMask
    from burstattn.masks.blocks import mask_blocks
    from burstattn.layouts.partition import layout_positions

    layout, mask = point_layout(p, p.seq_len, world), point_mask(p, p.seq_len)
    pos = layout_positions(layout, p.seq_len, world)
    sparse = mask is not None or not isinstance(layout, str)
    blocks = mask_blocks(mask or AttnMask(), p.seq_len) if sparse else None
    return [plan_cost(build_plan(r, world, positions=pos, causal=p.causal, travelling="kv",
                                 schedule="sparse" if sparse else p.schedule, blocks=blocks))
            for r in range(world)]


def useful_pairs(p: MaskPoint) -> int:
    """Visible (query, key) pairs of the mask over the whole sequence."""
    from burstattn.masks import AttnMask

    lo, hi = (point_mask(p, p.seq_len) or AttnMask()).intervals(torch.arange(p.seq_len), p.seq_len, p.causal)
    return int((hi - lo + 1).clamp_min(0).sum())


def _median(samples_by_rank: list[list[float]]) -> float:
    """Median over repeats of the slowest rank's time in each repeat."""
    return statistics.median(max(rep) for rep in zip(*samples_by_rank))


def combine(p: MaskPoint, world: int, ranks: list[dict]) -> dict:
    """One JSON record from every rank's result."""
    from burstattn.masks import balance

    rec: dict = {"suite": p.suite, "name": p.name, "layout": p.layout, "world_size": world, "config": asdict(p)}
    if any("unavailable" in r for r in ranks):
        return {**rec, "unavailable": next(r["unavailable"] for r in ranks if "unavailable" in r)}
    rec["errors"] = {k: max(r["check"][k] for r in ranks) for k in ("out", "dq", "dk", "dv")}
    rec["row_errors"] = {k: max(r["rows"][k] for r in ranks) for k in ("out", "dq")}
    rec["rows_checked_per_rank"] = ranks[0]["rows"]["rows"]
    rec["median_s"] = {ph: _median([r["samples"][ph] for r in ranks]) for ph in ("fwd", "fwd+bwd")}
    rec["samples_s"] = {ph: [r["samples"][ph] for r in ranks] for ph in ("fwd", "fwd+bwd")}
    rec["backward_used"] = ranks[0]["formula"]["backward"]
    rec["sent_per_rank"] = [r["sent"] for r in ranks]
    rec["formula_per_rank"] = [r["formula"]["ops"] for r in ranks]
    rec["bytes_match"] = all(_matches(r["sent"], r["formula"]["ops"]) for r in ranks)
    rec["sent_total"] = {ph: [sum(r["sent"][ph].values()) for r in ranks] for ph in ("fwd", "fwd+bwd")}
    work = rank_costs(p, world)
    rec["work_per_rank"], rec["balance"] = work, balance(work)
    rec["useful_pairs"] = useful_pairs(p)
    if p.documents:
        rec["cu_seqlens"] = packed_documents(p.seq_len, p.documents, p.doc_seed)
    return rec


def _matches(sent: dict, formula: dict) -> bool:
    """Forward call = the formula's forward ops; forward+backward call = all of them (per op, exact)."""
    fwd = {k: v for k, v in formula.items() if k.startswith("forward/")}
    return all(sent[ph].get(k, 0) == want.get(k, 0)
               for ph, want in (("fwd", fwd), ("fwd+bwd", formula)) for k in set(sent[ph]) | set(want))


def _ok(r: dict) -> bool:
    tol = TOLERANCE[r["config"]["dtype"]]
    return max(r["errors"].values()) <= tol and max(r["row_errors"].values()) <= tol


def _dense_base(records: list[dict]) -> Optional[dict]:
    return next((r for r in records if r["suite"] == "masks" and r["name"] == "dense causal"
                 and r["layout"] == "zigzag" and "median_s" in r), None)


def derive(records: list[dict]) -> None:
    """Add ``correct``, the ratios against each suite's baseline and the target verdicts, in place.

    masks: time, bytes (all ranks summed) and useful work against dense causal zigzag;
    distflash: causal time against the non-causal ring of the same world size, and the plan's own
    ratio (max-rank work against the non-causal max-rank work).
    """
    base = _dense_base(records)
    for r in records:
        if "median_s" not in r:
            continue
        r["correct"] = _ok(r)
        m = r["median_s"]
        if r["suite"] == "masks" and base is not None:
            sent = {ph: sum(r["sent_total"][ph]) / sum(base["sent_total"][ph]) for ph in ("fwd", "fwd+bwd")}
            r["vs_dense"] = {"work": r["useful_pairs"] / base["useful_pairs"],
                             "time": {ph: m[ph] / base["median_s"][ph] for ph in ("fwd", "fwd+bwd")},
                             "bytes": sent}
            if r["config"]["target"] is not None:
                r["met"] = r["vs_dense"]["time"]["fwd+bwd"] <= r["config"]["target"]
        elif r["suite"] == "distflash":
            nc = next((x for x in records if x["suite"] == "distflash" and x["world_size"] == r["world_size"]
                       and not x["config"]["causal"] and "median_s" in x), None)
            if nc is None:
                continue
            r["vs_noncausal"] = {ph: m[ph] / nc["median_s"][ph] for ph in ("fwd", "fwd+bwd")}
            r["plan_ratio"] = max(r["work_per_rank"]) / max(nc["work_per_rank"])
            if r["config"]["target"] is not None:
                r["met"] = r["vs_noncausal"]["fwd+bwd"] <= r["config"]["target"]


def _pair(d: dict) -> str:
    """``{"fwd": x, "fwd+bwd": y}`` as ``"x / y"`` ratios."""
    return f"{d['fwd']:.3f}x / {d['fwd+bwd']:.3f}x"


def _verdict(r: dict) -> str:
    if "met" not in r:
        return "-"
    return f"<= {r['config']['target']:.3g}x: " + ("met" if r["met"] else "**missed**")


def _correct(r: dict) -> str:
    e, w = r["errors"], r["row_errors"]
    return (("yes" if r["correct"] else "**WRONG**") + f" ({max(e.values()):.1e} / {max(w.values()):.1e})")


def _missing(r: dict, width: int) -> Optional[list[str]]:
    why = r.get("unavailable") or r.get("failed")
    if why is None:
        return None
    return [r["name"], r["layout"], "n/a: " + why.strip().splitlines()[-1][:160].replace("|", "/")] + [""] * (width - 3)


def _ints(xs) -> str:
    return " / ".join(f"{x:,}" for x in xs)


def _phase(ops: dict, phase: str) -> int:
    return sum(v for k, v in ops.items() if k.startswith(phase + "/"))


def _bytes_rows(recs: list[dict]) -> list[list[str]]:
    rows = []
    for r in recs:
        if "median_s" not in r:
            continue
        sent, want = r["sent_per_rank"], r["formula_per_rank"]
        bwd_ops = sorted({k.split("/")[1] for f in want for k in f if k.startswith("backward/")})
        rows.append([r["name"], r["layout"], r["backward_used"],
                     _ints(sum(s["fwd"].values()) for s in sent), _ints(_phase(f, "forward") for f in want),
                     _ints(sum(s["fwd+bwd"].values()) - sum(s["fwd"].values()) for s in sent),
                     _ints(_phase(f, "backward") for f in want), ", ".join(bwd_ops),
                     "yes" if r["bytes_match"] else "**no**"])
    return rows


def _masks_section(recs: list[dict]) -> list[str]:
    from burstattn.masks import AttnMask

    c, world = recs[0]["config"], recs[0]["world_size"]
    win = next((r["config"]["window_div"] for r in recs if r["config"]["window_div"]), None)
    docs = next((r for r in recs if "cu_seqlens" in r), None)
    cu = docs["cu_seqlens"] if docs else None
    rows = []
    for r in recs:
        miss = _missing(r, 12)
        if miss:
            rows.append(miss)
            continue
        m, vs = r["median_s"], r.get("vs_dense")
        rows.append([r["name"], r["layout"], _correct(r), seconds(m["fwd"]), seconds(m["fwd+bwd"]),
                     f"{vs['work']:.3f}" if vs else "-", _pair(vs["time"]) if vs else "-",
                     _pair(vs["bytes"]) if vs else "-", f"{r['balance']:.3f}",
                     f"{sum(r['work_per_rank']) / r['useful_pairs']:.3f}",
                     f"{vs['time']['fwd+bwd'] / vs['work']:.2f}" if vs else "-", _verdict(r)])
    out = [f"### Sliding window and packed documents (P={world}, N={c['seq_len']}, causal)", "",
           f"{c['heads']} heads (kv {c['kv_heads']}), head_dim {c['head_dim']}, batch {c['batch']}, {c['dtype']}. "
           + (f"Window: `window=(N/{win}, 0)`. " if win else "")
           + (f"Documents (`cu_seqlens`, cut points at seeded uniform fractions, seed {docs['config']['doc_seed']}): "
              f"`{cu}`, lengths {[b - a for a, b in zip(cu, cu[1:])]}. " if cu else "")
           + "\"documents\" layout: `partition.document_partition(cu_seqlens, P, causal=True)`. "
           "Ratios are against dense causal zigzag: useful work = visible (q, k) pairs of the mask; "
           "bytes = all ranks' sent bytes summed; \"time / work\" = fwd+bwd time ratio over work ratio "
           "(1.0: time falls exactly in proportion to the work); \"computed / useful\": score entries the "
           f"kernels compute (whole {AttnMask().block_size}-token tiles where a tile is partly visible) over the "
           "visible pairs.", ""]
    out += md_table(["point", "layout", "correct (max err: N-check / full-size rows)", "fwd", "fwd+bwd",
                   "useful work / dense", "time / dense (fwd / fwd+bwd)", "bytes / dense (fwd / fwd+bwd)",
                   "balance (max/mean)", "computed / useful", "time / work", "target"], rows) + [""]
    return out


def _distflash_section(recs: list[dict]) -> list[str]:
    c, world = recs[0]["config"], recs[0]["world_size"]
    rows = []
    for r in recs:
        miss = _missing(r, 10)
        if miss:
            rows.append(miss)
            continue
        m, vs = r["median_s"], r.get("vs_noncausal")
        causal = r["config"]["causal"]
        rows.append([r["name"], r["layout"], _correct(r), seconds(m["fwd"]), seconds(m["fwd+bwd"]),
                     _pair(vs) if vs and causal else "-",
                     f"{r['plan_ratio']:.3f}" if vs and causal else "-", f"{r['balance']:.3f}",
                     f"{max(sum(s['fwd+bwd'].values()) for s in r['sent_per_rank']):,}",
                     _verdict(r)])
    return [f"### DistFlashAttn against the ring layouts (P={world}, N={c['seq_len']})", "",
            f"{c['heads']} heads (kv {c['kv_heads']}), head_dim {c['head_dim']}, {c['dtype']}. \"plan\": max over ranks "
            "of the score entries computed, over the non-causal ring's (the time ratio a rank per core would "
            "show; for distflash 0.5 at every P: the last step of an even P is split in row halves).", ""] \
        + md_table(["schedule", "layout", "correct (max err: N-check / full-size rows)", "fwd", "fwd+bwd",
                  "causal / non-causal (fwd / fwd+bwd)", "plan", "balance (max/mean)",
                  "sent fwd+bwd per rank (max)", "target"], rows) + [""]


def masks_markdown(doc: dict) -> str:
    """The section (``## ...`` heading, intro, tables) for a ``bench masks`` JSON document."""
    m, cfg = doc["machine"], doc["config"]
    code = doc.get("code")
    worlds = sorted({r["world_size"] for r in doc["records"]})
    loads = {r["world_size"]: r.get("other_load_during_spawn") for r in doc["records"]}
    out = [SECTION, "",
           f"Generated by `burstattn bench masks{' --quick' if cfg['quick'] else ''}` on {doc['started']} "
           f"({doc['duration_s']:.0f} s); {m['cpu']}, {m['cores']} cores, torch {m['torch']}"
           + (f", commit `{code['commit']}`{' with uncommitted changes' if code['dirty'] else ''}" if code else "")
           + f". Threads: {doc['threads']}: {' and '.join(map(str, worlds))} ranks share the {m['cores']} cores, "
           "which stretches every time alike, except that a rank waiting on a slower one frees its core for "
           "the others, so imbalance costs less time here than with a core per rank (read the balance figure "
           f"beside the times). Medians of {cfg['repeats']} repeats (a repeat = its slowest rank) after the byte "
           f"calls and {cfg['warmup']} more warm-up. Correct: out / dQ / dK / dV of every rank's rows against the "
           f"float64 dense reference with the mask on a {cfg['check_seq_len']}-token instance of the point, and "
           f"out / dQ of {cfg['check_rows']} sampled rows per rank of the full-size run; all <= "
           f"{TOLERANCE[cfg['dtype']]:g} relative. Balance: max over mean of the score entries each rank computes "
           "in the partition and schedule actually run. Other processes during each spawn (cores): "
           + "; ".join(f"P={w}: {x['other_cores']}" for w, x in sorted(loads.items()) if x) + ".", ""]
    masks = [r for r in doc["records"] if r["suite"] == "masks"]
    if masks:
        out += _masks_section(masks)
    for w in sorted({r["world_size"] for r in doc["records"] if r["suite"] == "distflash"}):
        out += _distflash_section([r for r in doc["records"] if r["suite"] == "distflash" and r["world_size"] == w])
    measured = [r for r in doc["records"] if "median_s" in r]
    if measured:
        out += ["### Bytes sent per rank: measured (`comm_stats`) vs formula", "",
                "One forward, then one forward+backward; per rank (rank 0 / 1 / ...). Formulas: "
                "`masks.mask_bytes(mask_plan(...))` for a mask or a partition, `engine.bytes.ring_bytes` for the "
                "dense ring, `engine.bytes.distflash_bytes` for distflash. \"match\": every rank sent exactly the "
                "formula's bytes for every (phase, op), forward alone and forward+backward.", ""]
        out += md_table(["point", "layout", "backward", "fwd sent", "fwd formula", "bwd sent", "bwd formula",
                       "bwd ops", "match"], _bytes_rows(measured)) + [""]
    return "\n".join(out)


def _block(lines: list[str], start: int, stop_prefixes: tuple[str, ...]) -> int:
    """Index of the first line after ``start`` that begins with one of ``stop_prefixes`` (or the end)."""
    return next((i for i in range(start + 1, len(lines)) if lines[i].startswith(stop_prefixes)), len(lines))


def update_section(path: str | Path, generated: str) -> None:
    """Replace (or append) the :data:`SECTION` of ``path`` with ``generated``, keeping the old
    section's ``### Reading...`` subsection (placed after the new intro) and the rest of the file."""
    path = Path(path)
    lines = path.read_text().splitlines() if path.exists() else []
    start = next((i for i, line in enumerate(lines) if line.startswith(SECTION)), None)
    reading: list[str] = []
    if start is None:
        before, after = lines + ([""] if lines and lines[-1].strip() else []), []
    else:
        end = _block(lines, start, ("## ",))
        before, after, old = lines[:start], lines[end:], lines[start:end]
        at = next((i for i, line in enumerate(old) if line.startswith("### Reading")), None)
        if at is not None:
            reading = old[at:_block(old, at, ("### ", "## "))]
            reading = reading + ([""] if reading[-1].strip() else [])
    new = generated.rstrip("\n").splitlines() + [""]
    first_sub = next((i for i, line in enumerate(new) if line.startswith("### ")), len(new))
    new = new[:first_sub] + reading + new[first_sub:]
    path.write_text("\n".join(before + new + after).rstrip("\n") + "\n")

"""Markdown for ``burstattn bench --cluster`` runs, and their section of bench/results/cluster.md."""
from __future__ import annotations

import re
from pathlib import Path

SECTION = "## Emulated clusters: `burstattn bench --cluster`"


def _s(x) -> str:
    return "-" if x is None else f"{x:.3f} s"


def _mb(x) -> str:
    return "-" if x is None else f"{x / 2**20:.1f}"


def _latency_note(result: dict) -> str:
    req = result.get("requested", result["spec"])
    if (req["inter"]["latency_ms"], req["intra"]["latency_ms"]) == (result["spec"]["inter"]["latency_ms"],
                                                                  result["spec"]["intra"]["latency_ms"]):
        return ""
    return (f"; the preset asks {req['inter']['latency_ms']:.3g} / {req['intra']['latency_ms']:.3g} ms, not "
            "emulated: this kernel has no netem")


def cluster_markdown(result: dict) -> str:
    """One run: a heading and a table (shaped vs unshaped, exposed communication, bytes)."""
    spec, cfg = result["spec"], result["config"]
    base = {r["contender"]: r for r in result["unshaped"]}
    burst = next((r for r in result["shaped"] if r["contender"] == "burst"), None)
    head = (f"### {spec['name']}, {spec['nodes']} nodes x {spec['ranks_per_node']} ranks, N={cfg['seq_len']}, "
            f"{'causal' if cfg['causal'] else 'non-causal'}")
    inter, intra = spec["inter"], spec["intra"]
    lines = [head, "",
             f"Links: inter {inter['bandwidth'] / 1e6 if inter['bandwidth'] else float('inf'):.3g} MB/s, intra "
             f"{intra['bandwidth'] / 1e6 if intra['bandwidth'] else float('inf'):.3g} MB/s per node (latency "
             f"{inter['latency_ms']:g} / {intra['latency_ms']:g} ms{_latency_note(result)}); kernel {result['per_core_flops'] / 1e9:.1f} "
             f"GFLOP/s per core, {result['local_flops'] / 1e9:.1f} per rank. {cfg['heads']} heads (kv "
             f"{cfg['kv_heads']}), head_dim {cfg['head_dim']}, float32, medians of {cfg['repeats']} (slowest rank). "
             f"Run {result['date']}, {result['wall_s']:.0f} s.", "",
             "| strategy | correct (max rel err) | fwd | fwd+bwd | fwd+bwd unshaped | exposed comm (shaped - unshaped) "
             "| traced wait | sent per rank fwd+bwd MiB | inter-node MiB/rank | intra-node MiB/rank | fwd+bwd vs burst |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["shaped"]:
        name = r["contender"]
        if "median_s" not in r:
            lines.append(f"| {name} | {r.get('failed') or r.get('unavailable')} |" + " - |" * 9)
            continue
        err = max(r["errors"].values())
        b = base.get(name, {}).get("median_s", {}).get("fwd+bwd")
        t = r["median_s"]["fwd+bwd"]
        exposed = None if b is None else t - b
        vs = "-" if burst is None or "median_s" not in burst else f"{t / burst['median_s']['fwd+bwd']:.2f}x"
        iface = r.get("iface_per_rank", {})
        lines.append(f"| {name} | {'yes' if err < 1e-4 else 'NO'} ({err:.1e}) | {_s(r['median_s']['fwd'])} | {_s(t)} | "
                     f"{_s(b)} | {_s(exposed)} | {_s(r.get('wait_s'))} | {_mb(r['sent_bytes']['fwd+bwd'])} | "
                     f"{_mb(iface.get('inter'))} | {_mb(iface.get('intra'))} | {vs} |")
    from bench.cluster.spec import ClusterSpec, Link, ring_schedule
    chosen = ring_schedule(ClusterSpec(spec["nodes"], spec["ranks_per_node"], Link(inter["bandwidth"]),
                                       Link(intra["bandwidth"])))
    lines += ["", f"The spec calls for burst's `schedule={chosen!r}` "
              f"(`cluster.spec.ring_schedule`: the two-level ring when the intra-node link is the faster one)."]
    lines += ["", "Traced wait: time the slowest rank spent waiting for transfers in one traced forward + backward "
              "(ring loops only; '0.000' for strategies built on collectives, whose waits are inside the "
              "collective). Interface bytes are the node's counters over one traced forward + backward divided by "
              "its ranks (TCP/IP headers included).", ""]
    return "\n".join(lines)


def append_section(path: str, result: dict, md: str) -> None:
    """Put ``md`` into the cluster section of ``path`` (replacing the same heading's previous run;
    a hand-written ``### Reading`` stays first)."""
    p = Path(path)
    text = p.read_text() if p.exists() else ""
    heading = md.splitlines()[0]
    if SECTION not in text:
        text = text.rstrip() + f"\n\n{SECTION}\n\n"
    start = text.index(SECTION)
    nxt = re.search(r"^## ", text[start + len(SECTION):], flags=re.M)
    end = start + len(SECTION) + nxt.start() if nxt else len(text)
    body = text[start + len(SECTION):end]
    if heading in body:
        i = body.index(heading)
        j = body.find("\n### ", i + len(heading))
        body = body[:i] + md.rstrip() + "\n" + (body[j:] if j >= 0 else "\n")
    else:
        body = body.rstrip() + "\n\n" + md.rstrip() + "\n\n"
    p.write_text(text[:start] + SECTION + body + text[end:])

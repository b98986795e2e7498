"""The simulator against measurement here and against the papers' published figures.

* :func:`grid_rows`: ``burstattn bench grid`` (P=2 on this machine, attention fwd+bwd) against the
  simulator on this machine's calibrated spec (``burstattn sim calibrate``).
* :func:`cluster_rows`: ``burstattn bench --cluster`` (2 nodes x 2 ranks on the emulated cluster)
  against the simulator on the emulated cluster's own links and calibrated rates.
* :func:`paper_rows`: the published figures of BurstAttention, DistFlashAttn, RingAttention and
  Meta's context-parallel inference beside the simulator's predictions for the same setups.

``python -m burstattn.sim.validation --calibration FILE`` prints the Markdown tables of
bench/results/simulation.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Optional

import torch

from ..models.config import preset as model_preset
from .attention import AttnShape, attention_timeline
from .hardware import ClusterHW, load, preset
from .step import SimConfig, memory_model, simulate

# bench contender -> (strategy, options) as the committed `bench grid` / `bench --cluster` runs ran them
# (their records carry no layout: these were the strategies' default layouts then)
CONTENDERS = {"burst": ("burst", {"layout": "zigzag"}),
              "burst-distflash": ("burst", {"schedule": "distflash", "layout": "contiguous"}),
              "burst-double": ("burst", {"schedule": "double", "layout": "zigzag"}),
              "ring": ("ring", {"layout": "contiguous"}), "rsa": ("rsa", {"layout": "contiguous"}),
              "ulysses": ("ulysses", {"layout": "contiguous"}), "allgather": ("allgather", {"layout": "contiguous"}),
              "usp": ("usp", {"ulysses_degree": 2, "layout": "zigzag"}), "tp": ("tp", {"layout": "contiguous"})}


def predict_attention(contender: str, hw: ClusterHW, *, world: int, seq_len: int, causal: bool, heads: int,
                      kv_heads: int, head_dim: int, dtype: torch.dtype, batch: int = 1) -> dict:
    """Predicted ``{"fwd", "fwd+bwd"}`` seconds of one attention call as the benchmarks time it."""
    strategy, opts = CONTENDERS[contender]
    shape = AttnShape(batch, seq_len, heads, kv_heads, head_dim, dtype, causal)
    t = attention_timeline(strategy, shape, hw, world, **opts)
    return {"fwd": t.forward.time, "fwd+bwd": t.forward.time + t.backward.time}


def grid_rows(targets: dict, hw: ClusterHW) -> list[dict]:
    """One row per (contender, N, causal) of a ``bench grid`` JSON that the simulator models."""
    rows = []
    for rec in targets["records"]:
        c = rec.get("contender")
        if c not in CONTENDERS or "median_s" not in rec or not rec.get("median_s"):
            continue
        cfg = rec["config"]
        pred = predict_attention(c, hw, world=rec["world_size"], seq_len=cfg["seq_len"], causal=cfg["causal"],
                                 heads=cfg["heads"], kv_heads=cfg["kv_heads"], head_dim=cfg["head_dim"],
                                 dtype=getattr(torch, cfg["dtype"]), batch=cfg["batch"])
        meas = rec["median_s"]["fwd+bwd"]
        rows.append({"contender": c, "seq_len": cfg["seq_len"], "causal": cfg["causal"], "measured_s": meas,
                     "predicted_s": pred["fwd+bwd"], "error": pred["fwd+bwd"] / meas - 1,
                     "measured_fwd_s": rec["median_s"]["fwd"], "predicted_fwd_s": pred["fwd"]})
    return rows


def emulated_hw(cluster: dict, cal: ClusterHW) -> ClusterHW:
    """The emulated cluster of a ``bench --cluster`` JSON as a :class:`ClusterHW`: its shaped links
    (each node's loopback and veth are shared by the node's ranks), its per-rank attention rate
    (``local_flops``; the backward, matmul and memory rates scaled from ``cal`` alike)."""
    spec = cluster["spec"]
    scale = cluster["local_flops"] / cal.attn_rate(False)

    def bw(link: dict) -> float:
        return link["bandwidth"] if link["bandwidth"] else cal.intra_bw

    return dataclasses.replace(
        cal, name=f"emulated {spec['name']}", devices_per_node=spec["ranks_per_node"],
        peak_flops=cal.peak_flops * scale, mem_bw=cal.mem_bw * scale, intra_bw=bw(spec["intra"]),
        inter_bw=bw(spec["inter"]), intra_lat=spec["intra"]["latency_ms"] / 1e3 + cal.intra_lat,
        inter_lat=spec["inter"]["latency_ms"] / 1e3 + cal.inter_lat, intra_shared=True, inter_shared=True)


def cluster_rows(cluster: dict, cal: ClusterHW) -> list[dict]:
    hw = emulated_hw(cluster, cal)
    cfg = cluster["config"]
    rows = []
    for rec in cluster["shaped"]:
        c = rec["contender"]
        if c not in CONTENDERS or not rec.get("median_s"):
            continue
        pred = predict_attention(c, hw, world=rec["world_size"], seq_len=cfg["seq_len"], causal=cfg["causal"],
                                 heads=cfg["heads"], kv_heads=cfg["kv_heads"], head_dim=cfg["head_dim"],
                                 dtype=torch.float32)
        meas = rec["median_s"]["fwd+bwd"]
        rows.append({"contender": c, "cluster": cluster["spec"]["name"], "seq_len": cfg["seq_len"],
                     "causal": cfg["causal"], "measured_s": meas, "predicted_s": pred["fwd+bwd"],
                     "error": pred["fwd+bwd"] / meas - 1})
    return rows


def same_ranking(rows: list[dict], tie: float = 0.0, predicted_tie: float = 0.0) -> tuple[bool, list[tuple[str, str]]]:
    """Whether predicted and measured times order the contenders alike; the discordant pairs
    (pairs whose measured times differ by less than ``tie``, or predicted by less than
    ``predicted_tie``, relatively, are not counted)."""
    bad = []
    for i, a in enumerate(rows):
        for b in rows[i + 1:]:
            dm = a["measured_s"] - b["measured_s"]
            dp = a["predicted_s"] - b["predicted_s"]
            if (abs(dm) > tie * max(a["measured_s"], b["measured_s"])
                    and abs(dp) > predicted_tie * max(a["predicted_s"], b["predicted_s"]) and dm * dp < 0):
                bad.append((a["contender"], b["contender"]))
    return not bad, bad


def _train(model: str, n: int, hw: str, strategy: str, **kw) -> float:
    return simulate(SimConfig(model_preset(model), n, preset(hw), strategy, "train", **kw)).time_s


def _prefill(model: str, n: int, hw: str, strategy: str, **kw) -> float:
    return simulate(SimConfig(model_preset(model), n, preset(hw), strategy, "prefill", **kw)).time_s


def _longest(model: str, hw: ClusterHW, cp: int, dp: int, strategy: str = "ring", step: int = 16384) -> int:
    lo, hi = 0, step
    # one sequence per data-parallel replica: the global batch is dp
    cfg = SimConfig(model_preset(model), step, hw, strategy, "train", cp=cp, dp=dp, batch=dp, checkpointing="full",
                    fsdp=True)
    fits = lambda n: memory_model(dataclasses.replace(cfg, seq_len=n)).fits  # noqa: E731
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def paper_rows() -> list[dict]:
    """``[{"paper", "setup", "what", "published", "predicted", "kind"}]``: kind ``time`` (s),
    ``ratio`` or ``tokens``."""
    rows = []
    for n, tp3, burst in ((32768, 5.67, 3.27), (131072, 28.73, 16.01)):
        a = _prefill("llama-7b", n, "a100-pcie-roce", "tp-v3", tp=8)
        b = _prefill("llama-7b", n, "a100-pcie-roce", "burst", cp=8)
        setup = f"LLaMA-7B prefill, batch 1, {n // 1024}K tokens, 8 A100 PCIe (a100-pcie-roce, one node)"
        rows += [dict(paper="BurstAttention T2", setup=setup, what="TP-V3 (tp=8)", published=tp3, predicted=a, kind="time"),
                 dict(paper="BurstAttention T2", setup=setup, what="BurstAttention (cp=8)", published=burst,
                      predicted=b, kind="time"),
                 dict(paper="BurstAttention T2", setup=setup, what="TP-V3 / Burst", published=tp3 / burst,
                      predicted=a / b, kind="ratio")]
    # the same work per step (global batch 4: one 128K sequence per node-sized replica) for both
    tp3 = _train("llama-7b", 131072, "a100-pcie-roce", "tp-v3", tp=8, dp=4, batch=4, checkpointing="full", fsdp=True)
    burst = _train("llama-7b", 131072, "a100-pcie-roce", "burst", cp=8, dp=4, batch=4, checkpointing="full", fsdp=True)
    rows.append(dict(paper="BurstAttention", setup="LLaMA-7B training, 128K tokens, 32 A100 PCIe + RoCE (4 nodes), "
                     "full checkpointing, FSDP, global batch 4", what="TP-V3 (tp=8, dp=4) / Burst (cp=8, dp=4)",
                     published=1.37, predicted=tp3 / burst, kind="ratio"))
    shape = AttnShape(1, 131072, 32, 32, 128, torch.bfloat16, True)
    hw = preset("a100-pcie-roce")
    b = attention_timeline("burst", shape, hw, 32, backward="burst")
    r = attention_timeline("ring", shape, hw, 32)
    rows.append(dict(paper="BurstAttention", setup="bytes per attention layer, fwd+bwd, 128K, 32 ranks, MHA 32x128, "
                     "bf16 (float32 accumulators travel)", what="Burst bytes / Ring bytes (paper: (2+3)/(2+6) in "
                     "elements)", published=5 / 8, predicted=(b.forward.bytes_sent + b.backward.bytes_sent) /
                     (r.forward.bytes_sent + r.backward.bytes_sent), kind="ratio"))
    # DistFlashAttn Table 1 (FSDP) and Table 5 (checkpointing)
    for gpus, per_gpu, meg, dfa in ((8, 32768, 72.75, 58.46), (16, 16384, 43.44, 30.21)):
        n = gpus * per_gpu
        setup = (f"LLaMA-7B, {per_gpu // 1024}K tokens per GPU, {gpus // 8} DGX A100 box(es)"
                 + (" over 100 Gb/s IB" if gpus > 8 else "") + " (a100-nvlink-ib), FSDP")
        a = _train("llama-7b", n, "a100-nvlink-ib", "tp-v3", tp=gpus, checkpointing="full")
        b = _train("llama-7b", n, "a100-nvlink-ib", "burst", cp=gpus, schedule="distflash", checkpointing="remat",
                   fsdp=True)
        rows += [dict(paper="DistFlashAttn T1", setup=setup, what=f"Megatron-LM (tp-v3, tp={gpus})", published=meg,
                      predicted=a, kind="time"),
                 dict(paper="DistFlashAttn T1", setup=setup, what=f"DistFlashAttn (cp={gpus}, remat)", published=dfa,
                      predicted=b, kind="time"),
                 dict(paper="DistFlashAttn T1", setup=setup, what="Megatron / DistFlashAttn", published=meg / dfa,
                      predicted=a / b, kind="ratio")]
    # the same 2-box run if "100 Gb/s InfiniBand" is per GPU (a DGX A100 has 8 compute NICs), not per node
    per_gpu = dataclasses.replace(preset("a100-nvlink-ib"), inter_shared=False)
    cfgs = [SimConfig(model_preset("llama-7b"), 16 * 16384, per_gpu, "tp-v3", "train", tp=16, checkpointing="full"),
            SimConfig(model_preset("llama-7b"), 16 * 16384, per_gpu, "burst", "train", cp=16, schedule="distflash",
                      checkpointing="remat", fsdp=True)]
    a, b = (simulate(c).time_s for c in cfgs)
    setup = "as above, 2 boxes, if the 100 Gb/s is per GPU (a100-nvlink-ib with inter_shared=False)"
    rows += [dict(paper="DistFlashAttn T1", setup=setup, what="Megatron-LM (tp-v3, tp=16)", published=43.44,
                  predicted=a, kind="time"),
             dict(paper="DistFlashAttn T1", setup=setup, what="DistFlashAttn (cp=16, remat)", published=30.21,
                  predicted=b, kind="time"),
             dict(paper="DistFlashAttn T1", setup=setup, what="Megatron / DistFlashAttn", published=43.44 / 30.21,
                  predicted=a / b, kind="ratio")]
    setup = "LLaMA-7B, 16K tokens per GPU, 8 A100 NVLink, batch 1, FSDP, distflash schedule"
    full = _train("llama-7b", 8 * 16384, "a100-nvlink-ib", "burst", cp=8, schedule="distflash",
                  checkpointing="full", fsdp=True)
    remat = _train("llama-7b", 8 * 16384, "a100-nvlink-ib", "burst", cp=8, schedule="distflash",
                   checkpointing="remat", fsdp=True)
    rows += [dict(paper="DistFlashAttn T5", setup=setup, what="ordinary checkpointing", published=21.44,
                  predicted=full, kind="time"),
             dict(paper="DistFlashAttn T5", setup=setup, what="rematerialization-aware", published=17.26,
                  predicted=remat, kind="time"),
             dict(paper="DistFlashAttn T5", setup=setup, what="full / remat", published=21.44 / 17.26,
                  predicted=full / remat, kind="ratio")]
    # RingAttention Table 3 (FSDP, full checkpointing): longest context
    a100 = preset("a100-nvlink-ib")
    ring8, bpt8 = _longest("llama-7b", a100, 8, 1), _longest("llama-7b", a100, 1, 8, "burst")
    tpu = _longest("llama-7b", preset("tpuv4"), 1024, 1, step=1 << 18)
    setup = "LLaMA-7B training, FSDP, full checkpointing"
    rows += [dict(paper="RingAttention T3", setup=setup + ", 8 A100 NVLink", what="RingAttention (cp=8) tokens",
                  published=256 * 1024, predicted=ring8, kind="tokens"),
             dict(paper="RingAttention T3", setup=setup + ", 8 A100 NVLink",
                  what="memory-efficient attention, no sequence split (dp=8) tokens", published=32 * 1024,
                  predicted=bpt8, kind="tokens"),
             dict(paper="RingAttention T3", setup=setup + ", 8 A100 NVLink", what="ring / no split",
                  published=8.0, predicted=ring8 / max(bpt8, 1), kind="ratio"),
             dict(paper="RingAttention T3", setup=setup + ", TPUv4-1024", what="RingAttention (cp=1024) tokens",
                  published=8 * 2**20, predicted=tpu, kind="tokens")]
    meta = _prefill("llama3-405b", 131072, "h100-nvlink-ib", "burst", cp=16, tp=8, layout="zigzag")
    rows.append(dict(paper="Meta CP inference", setup="Llama3-405B prefill, 128K, TP8 in a host x CP16 across 16 "
                     "hosts of 8 H100, 400 Gb/s per GPU (h100-nvlink-ib), pass-KV ring, bf16 here (the paper: "
                     "FP8 weights)", what="prefill s", published=3.8, predicted=meta, kind="time"))
    return rows


# The longest trainable context the planner finds, against the published systems: (model, GPUs,
# cluster, offload allowed or not, the published figure and who published it)
TARGETS = (("llama3-8b", 1, "h100-nvlink-ib", None, 500 * 2**10, "DeepSpeed ALST (arXiv 2506.13996): 500K on 1 H100"),
           ("llama3-8b", 8, "h100-nvlink-ib", None, 5 * 2**20, "Untied Ulysses (arXiv 2602.21196): 5M on 8 H100"),
           ("llama3-8b", 32, "h100-nvlink-ib", None, 16 * 2**20, "the bar above ALST (15M on 32 H100)"),
           ("llama3-8b", 32, "h100-nvlink-ib", "none", 6 * 2**20, "the same bar without offload: 6M"),
           ("llama-7b", 32, "a100-nvlink-ib", None, 4 * 2**20, "RingAttention Table 3: 4M on 32 A100"),
           ("llama-7b", 32, "a100-nvlink-ib", "none", 4 * 2**20, "RingAttention Table 3: 4M on 32 A100"),
           ("llama-13b", 32, "a100-nvlink-ib", None, 2 * 2**20, "RingAttention Table 3: 2M on 32 A100"),
           ("llama-13b", 32, "a100-nvlink-ib", "none", 2 * 2**20, "RingAttention Table 3: 2M on 32 A100"))


def target_rows(labels: tuple[str, ...] = ("burst",)) -> list[dict]:
    """The planner's longest context for :data:`TARGETS` (strategies ``labels``), with the winning
    degrees and options and the memory term that binds one step further."""
    from .planner import MemoryChoice, max_seq_len

    rows = []
    for model, gpus, cluster, offload, published, who in TARGETS:
        res = max_seq_len(model_preset(model), gpus, preset(cluster), fixed=MemoryChoice(offload=offload), labels=labels)
        label, best = max(res.items(), key=lambda kv: kv[1]["tokens"])
        rows.append(dict(model=model, gpus=gpus, cluster=cluster, offload=offload or "searched", published=published,
                         who=who, strategy=label, **best))
    return rows


def targets_markdown(rows: list[dict]) -> str:
    """The table of bench/results/simulation.md: longest trainable context, options, what binds."""
    out = ["| model | GPUs | cluster | offload | longest context | published | strategy, degrees | checkpointing, chunks "
           "(MLP/loss), offload | peak / host per GPU | binds one step further |", "|---|---|---|---|---:|---|---|---|---|---|"]
    for r in rows:
        d, o = r["degrees"], r["options"]
        out.append(f"| {r['model']} | {r['gpus']} | {r['cluster']} | {r['offload']} | {r['tokens'] / 2**20:.2f}M | "
                   f"{r['who']} | {r['strategy']} dp={d['dp']} cp={d['cp']} tp={d['tp']} | {o['checkpointing']}, "
                   f"{o['mlp_chunk']}/{o['loss_chunk']}, {o['offload']} | {r['peak_memory_bytes'] / 2**30:.1f} / "
                   f"{r['host_memory_bytes'] / 2**30:.1f} GiB | {r['binding']} |")
    return "\n".join(out)


def _fmt(v: float, kind: str) -> str:
    if kind == "tokens":
        return f"{v / 1024:,.0f}K"
    if kind == "ratio":
        return f"{v:.2f}x" if v > 1 or kind == "ratio" else f"{v:.2f}"
    return f"{v:.2f} s"


def markdown(cal_path: str, data: str = "bench/results") -> str:
    """The validation tables of bench/results/simulation.md."""
    cal = load(cal_path)
    out = ["### Against `burstattn bench grid` (P=2 on this machine; `bench/results/targets.json`)", "",
           "| contender | N | mask | measured fwd+bwd | predicted | error |", "|---|---|---|---|---|---|"]
    grid = grid_rows(json.loads(Path(data, "targets.json").read_text()), cal)
    for r in grid:
        out.append(f"| {r['contender']} | {r['seq_len']} | {'causal' if r['causal'] else 'non-causal'} | "
                   f"{r['measured_s']:.3f} s | {r['predicted_s']:.3f} s | {r['error']:+.0%} |")
    for n in (8192, 16384):
        for causal in (False, True):
            sel = [r for r in grid if r["seq_len"] == n and r["causal"] == causal]
            ok, bad = same_ranking(sel)
            ok5, bad5 = same_ranking(sel, tie=0.05, predicted_tie=0.02)
            out.append(f"\nN={n} {'causal' if causal else 'non-causal'}: same ranking: {'yes' if ok else 'no'}"
                       f"{'' if ok else ' (swapped: ' + ', '.join('/'.join(p) for p in bad) + ')'}; ignoring ties "
                       f"(measured within 5% or predicted within 2% of each other): "
                       f"{'yes' if ok5 else 'no: ' + ', '.join('/'.join(p) for p in bad5)}")
    out += ["", "### Against `burstattn bench --cluster` (2 nodes x 2 ranks, emulated links)", "",
            "| cluster | N | mask | contender | measured fwd+bwd | predicted | error |", "|---|---|---|---|---|---|---|"]
    for f in sorted(Path(data).glob("cluster-*.json")):
        rows = cluster_rows(json.loads(f.read_text()), cal)
        for r in rows:
            out.append(f"| {r['cluster']} | {r['seq_len']} | {'causal' if r['causal'] else 'non-causal'} | "
                       f"{r['contender']} | {r['measured_s']:.3f} s | {r['predicted_s']:.3f} s | {r['error']:+.0%} |")
        ok, bad = same_ranking(rows, tie=0.05, predicted_tie=0.02)
        out.append(f"| | | | ranking, ties (5% measured, 2% predicted) aside | | | "
                   f"{'same' if ok else 'swapped: ' + ', '.join('/'.join(p) for p in bad)} |")
    out += ["", "### Against the papers", "", "| paper | setup | what | published | predicted | predicted / published |",
            "|---|---|---|---|---|---|"]
    for r in paper_rows():
        out.append(f"| {r['paper']} | {r['setup']} | {r['what']} | {_fmt(r['published'], r['kind'])} | "
                   f"{_fmt(r['predicted'], r['kind'])} | {r['predicted'] / r['published']:.2f} |")
    return "\n".join(out)


def main(argv: Optional[list] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calibration", default="bench/results/sim-calibration.json")
    ap.add_argument("--data", default="bench/results")
    ns = ap.parse_args(argv)
    print(markdown(ns.calibration, ns.data))


if __name__ == "__main__":
    main()

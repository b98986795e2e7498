"""``burstattn bench dispatch``: dynamic against static dispatch of long-tailed documents, in real
processes, and the planner's figures at scale.

Measured (``run``): two jobs in the same ranks, one ``--dispatch static`` (every document over the
fixed cp = P ring), one ``--dispatch dynamic``, the SAME documents (``--doc-lengths``, one seed) and
the same model. Each step runs both arms, alternating which goes first, so load drifts hit them alike.
Per rank and step: the CPU seconds of the rank's own thread (``time.thread_time``): a cluster waits
for its slowest rank, and here the ranks share cores, so the wall clock cannot show the imbalance.
Reported: median over the steps of the slowest rank's CPU seconds, and tokens per second.

Simulated (``simulate``): :class:`~burstattn.parallel.dispatch.DispatchCost` from a model and a
cluster preset of :mod:`burstattn.sim.hardware` (bf16 GEMM and attention rates, the inter-node link
for rings beyond one node); the best static cp (fitting the memory budget) against dynamic dispatch,
over steps of documents drawn from a long-tailed distribution.
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import Optional

import torch

from burstattn.parallel.dispatch import DispatchCost, divisors, plan_dispatch
from burstattn.train.documents import DocLengths


@dataclass(frozen=True)
class DispatchBenchConfig:
    """One measured run."""

    world_size: int = 4
    model: str = "small"
    seq_len: int = 8192
    batch: int = 4
    doc_lengths: str = "lognormal:512,1.5,32768"
    steps: int = 20
    strategy: str = "burst"


def _train_cfg(cfg: DispatchBenchConfig, dispatch: str):
    from burstattn.train import TrainConfig

    return TrainConfig(model=cfg.model, seq_len=cfg.seq_len, batch=cfg.batch, steps=cfg.steps + 1, warmup=1,
                       strategy=cfg.strategy, doc_lengths=cfg.doc_lengths, dispatch=dispatch, seed=0)


def rank_times(rank: int, world: int, cfg: DispatchBenchConfig) -> dict:
    """Per arm, this rank's thread CPU seconds and wall seconds of every step (after one warm-up)."""
    from burstattn.train import build_job, train_step

    jobs = {arm: build_job(_train_cfg(cfg, arm)) for arm in ("static", "dynamic")}
    cpu = {arm: [] for arm in jobs}
    wall = {arm: [] for arm in jobs}
    for step in range(cfg.steps + 1):
        arms = ("static", "dynamic") if step % 2 == 0 else ("dynamic", "static")
        for arm in arms:
            t0, w0 = time.thread_time(), time.perf_counter()
            train_step(jobs[arm], step)
            if step:  # step 0 warms both arms up
                cpu[arm].append(time.thread_time() - t0)
                wall[arm].append(time.perf_counter() - w0)
    return dict(cpu=cpu, wall=wall)


def run(cfg: DispatchBenchConfig) -> dict:
    """Both arms on ``cfg.world_size`` local ranks; per arm the median over steps of the slowest rank's
    CPU seconds, the mean rank's, and tokens per second (wall clock of the step, slowest rank)."""
    from burstattn.testing.launch import LocalPool

    pool = LocalPool(cfg.world_size, backend="gloo", threads_per_rank=1, timeout_s=7200.0, pg_timeout_s=1200.0)
    try:
        per_rank = pool.run(rank_times, cfg)
    finally:
        pool.close()
    out = {}
    tokens = cfg.batch * cfg.seq_len
    for arm in ("static", "dynamic"):
        steps = range(cfg.steps)
        slowest = [max(r["cpu"][arm][s] for r in per_rank) for s in steps]
        mean = [statistics.fmean(r["cpu"][arm][s] for r in per_rank) for s in steps]
        walls = [max(r["wall"][arm][s] for r in per_rank) for s in steps]
        out[arm] = dict(slowest_cpu_s=statistics.median(slowest), mean_cpu_s=statistics.median(mean),
                        tokens_per_s=tokens / statistics.median(walls))
    return out


def hw_cost(model, hw, *, element_size: int = 2) -> DispatchCost:
    """:class:`DispatchCost` of ``model`` (a LlamaConfig) on cluster ``hw`` (a ClusterHW): GEMMs at
    ``peak x matmul_eff``, attention at ``peak x attn_fwd_eff`` (causal blocks at ``causal_eff``),
    rings on the inter-node link (with its latency and one kernel launch per hop)."""
    attn_rate = hw.peak_flops * hw.attn_fwd_eff * hw.causal_eff
    return DispatchCost.for_model(model.dim, model.n_layers, model.n_heads, model.n_kv_heads, model.head_dim,
                                  model.ffn_dim, model.vocab_size, matmul_flops=hw.peak_flops * hw.matmul_eff,
                                  attn_flops=attn_rate, link_bytes_per_s=hw.inter_bw, element_size=element_size,
                                  hop_latency_s=hw.inter_lat + hw.kernel_overhead_s)


def simulate(model, hw, world: int, doc_lengths: str, *, tokens_per_gpu: int, budget: int, steps: int = 8,
             seed: int = 0) -> dict:
    """Mean step time (the slowest rank's estimate) of the best static cp and of dynamic dispatch over
    ``steps`` global batches of ``world x tokens_per_gpu`` tokens drawn from ``doc_lengths``; a static cp
    must hold its longest document under ``budget`` tokens per GPU."""
    cost = hw_cost(model, hw)
    spec = DocLengths.parse(doc_lengths) if isinstance(doc_lengths, str) else doc_lengths
    batches = [spec.sample(world * tokens_per_gpu, torch.Generator().manual_seed(seed * 1000 + s)) for s in range(steps)]
    longest = max(max(b) for b in batches)
    static = {}
    for cp in divisors(world):
        if -(-longest // cp) <= budget:
            static[cp] = statistics.fmean(max(plan_dispatch(b, world, cost, mode="static", cp=cp).loads) for b in batches)
    plans = [plan_dispatch(b, world, cost, budget=budget) for b in batches]
    dynamic = statistics.fmean(max(p.loads) for p in plans)
    if not static:
        raise ValueError(f"no static cp of {world} GPUs holds the longest document ({longest} tokens) under the "
                         f"budget of {budget} tokens per GPU")
    best = min(static, key=static.get)
    return dict(world=world, best_static_cp=best, static_s=static[best], dynamic_s=dynamic,
                speedup=static[best] / dynamic, longest=longest, static_by_cp=static,
                dynamic_balance=statistics.fmean(p.balance for p in plans),
                static_tokens_per_gpu=-(-longest // best),  # the largest shard one GPU holds (activations)
                dynamic_tokens_per_gpu=max(-(-q.length // q.degree) for p in plans for q in p.placements))


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = DispatchBenchConfig()
    p.add_argument("--world-size", type=int, default=d.world_size)
    p.add_argument("--model", default=d.model)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--batch", type=int, default=d.batch)
    p.add_argument("--doc-lengths", default=d.doc_lengths)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--simulate", action="store_true", help="print the simulated table (llama3-8b, h100-nvlink-ib)")
    p.add_argument("--histogram", default=None, help="with --simulate: a document length histogram file "
                                                     "(LENGTH COUNT per line) instead of the built-in cases")
    p.add_argument("--gpus", type=int, nargs="+", default=[64, 256, 1024], help="with --histogram: world sizes")
    p.add_argument("--cluster", default="h100-nvlink-ib", help="with --simulate: a cluster preset or spec file")
    p.add_argument("--sim-model", default="llama3-8b", help="with --simulate: the model preset")
    p.add_argument("--budget", type=int, default=32768, help="with --simulate: tokens per GPU a shard may hold")
    p.add_argument("--plot", default=None, metavar="PNG", help="with --simulate: also plot the speedups (matplotlib)")


def run_cli(ns: argparse.Namespace) -> int:
    if ns.simulate and ns.histogram:
        print(histogram_table(ns.histogram, ns.gpus, ns.sim_model, ns.cluster, ns.budget))
        return 0
    if ns.simulate:
        print(simulated_table(plot_path=ns.plot))
        return 0
    cfg = DispatchBenchConfig(ns.world_size, ns.model, ns.seq_len, ns.batch, ns.doc_lengths, ns.steps)
    res = run(cfg)
    print(f"world {cfg.world_size}, {cfg.model}, {cfg.batch} x {cfg.seq_len} tokens per step of --doc-lengths "
          f"{cfg.doc_lengths}, {cfg.steps} steps after one warm-up, arms alternating")
    print("| dispatch | slowest rank CPU s / step | mean rank CPU s / step | tokens/s |")
    print("|---|---:|---:|---:|")
    for arm, r in res.items():
        print(f"| {arm} | {r['slowest_cpu_s']:.3f} | {r['mean_cpu_s']:.3f} | {r['tokens_per_s']:.0f} |")
    print(f"slowest rank: static / dynamic = {res['static']['slowest_cpu_s'] / res['dynamic']['slowest_cpu_s']:.2f}x")
    return 0


SIM_CASES = (("lognormal:2048,1.5,131072", 64), ("lognormal:2048,2.0,1048576", 64),
             ("lognormal:2048,1.5,131072", 256), ("lognormal:2048,2.0,1048576", 256),
             ("lognormal:2048,2.0,1048576", 1024), ("lognormal:16384,0.0,16384", 256))


def simulated_table(tokens_per_gpu: int = 16384, budget: int = 32768, plot_path: Optional[str] = None) -> str:
    """The docs table: llama3-8b on h100-nvlink-ib, 16K tokens per GPU per step, 32K tokens per GPU
    budget (so a static cp must be at least longest / 32K)."""
    from burstattn.models import preset
    from burstattn.sim.hardware import preset as hw_preset

    model, hw = preset("llama3-8b"), hw_preset("h100-nvlink-ib")
    return _table([(spec, world) for spec, world in SIM_CASES], model, hw, tokens_per_gpu, budget, plot_path)


HEADER = ["| GPUs | document lengths | longest | best static cp | static step s | dynamic step s | speedup | "
          "largest shard static / dynamic (tokens per GPU) |", "|---:|---|---:|---:|---:|---:|---:|---|"]


PUBLISHED = {"Megatron-Core dynamic CP (up to)": 1.48, "WLB-LLM (mean)": 1.23, "FlexSP (up to)": 1.98,
             "Zeppelin (mean)": 2.80}


def plot(rows: list[tuple[str, float]], path: str) -> None:
    """Bars of the simulated speedups (``[(label, speedup)]``) beside the published figures (lines);
    needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.6))
    ax.bar(range(len(rows)), [v for _, v in rows], color="tab:blue")
    ax.set_xticks(range(len(rows)), [k for k, _ in rows], rotation=20, ha="right", fontsize=7)
    for i, (name, value) in enumerate(PUBLISHED.items()):
        ax.axhline(value, ls="--", lw=0.8, color=f"C{i + 1}", label=f"{name}: {value}x")
    ax.axhline(1.0, color="black", lw=0.6)
    ax.set_ylabel("dynamic / best static cp")
    ax.set_title("Simulated: llama3-8b, h100-nvlink-ib, 16K tokens per GPU per step")
    ax.set_ylim(0, 3.6)
    ax.legend(fontsize=7, loc="upper left", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _table(cases, model, hw, tokens_per_gpu: int, budget: int, plot_path: Optional[str] = None) -> str:
    lines, bars = list(HEADER), []
    for spec, world in cases:
        r = simulate(model, hw, world, spec, tokens_per_gpu=tokens_per_gpu, budget=budget)
        name = spec if isinstance(spec, str) else "histogram"
        bars.append((f"{world} GPUs, {name.replace('lognormal:', 'LN ')}", r["speedup"]))
        lines.append(f"| {world} | {name} | {r['longest']} | {r['best_static_cp']} | {r['static_s']:.2f} | "
                     f"{r['dynamic_s']:.2f} | {r['speedup']:.2f}x | {r['static_tokens_per_gpu']} / "
                     f"{r['dynamic_tokens_per_gpu']} |")
    if plot_path:
        plot(bars, plot_path)
    return "\n".join(lines)


def histogram_table(path: str, gpus, model_name: str, cluster: str, budget: int, tokens_per_gpu: int = 16384) -> str:
    """The simulated table for a length histogram file on each of ``gpus``."""
    from burstattn.models import preset
    from burstattn.sim.hardware import load
    from burstattn.train.documents import HistogramLengths, load_histogram

    lengths = HistogramLengths(tuple(load_histogram(path)))
    return _table([(lengths, g) for g in gpus], preset(model_name), load(cluster), tokens_per_gpu, budget)

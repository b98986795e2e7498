"""``burstattn sim``, ``burstattn sim calibrate`` and ``burstattn plan``: flags and handlers."""
from __future__ import annotations

import argparse
import json
import sys

from ..sim.names import CHECKPOINTING, MODES, OFFLOAD, SCHEDULES, STRATEGIES, rate, seconds, size

_OWN_DIM = {"tp-v1": "tp", "tp-v3": "tp"}


def _common(p: argparse.ArgumentParser, with_strategy: bool) -> None:
    p.add_argument("--model", default="llama-7b", help="a burstattn.models preset (llama-7b, llama3-8b, ...)")
    p.add_argument("--seq-len", type=int, default=None, help="global sequence length (decode: the cache length)")
    p.add_argument("--gpus", type=int, default=8, help="devices in all (default: %(default)s)")
    p.add_argument("--cluster", default="a100-nvlink-ib", help="a preset or a spec .json from `sim calibrate`")
    p.add_argument("--mode", default="train", choices=MODES if with_strategy else ("train", "prefill"))
    p.add_argument("--batch", type=int, default=1,
                   help="the global batch: sequences per step over all data-parallel replicas, as for "
                        "`burstattn train --batch` (it must divide by --dp; default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"),
                   help="weights and activations: float32 (what a CPU trains in: float32 Adam, no master copy, the "
                        "cluster's float32 rate) or 16-bit with float32 master weights (default: %(default)s)")
    for flag, text in (("--inter-gbps", "inter-node Gbit/s"), ("--intra-gbps", "intra-node Gbit/s"),
                       ("--gpu-tflops", "peak TFLOP/s per device"), ("--gpu-mem-gib", "memory per device, GiB")):
        p.add_argument(flag, type=float, default=None, help=f"override the cluster's {text}")


SIM_HELP = "simulate a strategy on a cluster (time, memory, timeline); `sim calibrate`"
PLAN_HELP = "rank every strategy and degree choice on a cluster; --max-seq-len"


def add(sub: argparse._SubParsersAction) -> None:
    """Add ``burstattn sim`` and ``burstattn plan`` to the subcommands ``sub``."""
    p = sub.add_parser("sim", help=SIM_HELP)
    add_sim_arguments(p)
    p.set_defaults(handler=run_sim)
    q = sub.add_parser("plan", help=PLAN_HELP)
    add_plan_arguments(q)
    q.set_defaults(handler=run_planner)


def add_sim_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", nargs="?", choices=["calibrate"], help="calibrate: measure this machine")
    _common(p, True)
    p.add_argument("--strategy", default="burst", choices=STRATEGIES)
    p.add_argument("--layout", default=None)
    p.add_argument("--schedule", default="ring", choices=SCHEDULES)
    p.add_argument("--cp", type=int, default=None)
    p.add_argument("--tp", type=int, default=None)
    p.add_argument("--dp", type=int, default=None)
    p.add_argument("--ulysses-degree", type=int, default=None, help="usp: the all-to-all degree")
    p.add_argument("--checkpointing", default="full", choices=CHECKPOINTING)
    p.add_argument("--fsdp", action="store_true")
    _memory_flags(p, searched=False)
    p.add_argument("--non-causal", action="store_true", help="bidirectional attention (default causal)")
    p.add_argument("--window", type=int, default=None, help="burst: a causal sliding window of this many keys")
    p.add_argument("--timeline", default=None, metavar="OUT.png", help="write one layer's Gantt chart")
    p.add_argument("--out", default="cluster-spec.json", help="calibrate: where to write the spec")
    p.add_argument("--seconds", type=float, default=1.0, help="calibrate: seconds per kernel measurement")
    p.add_argument("--rounds", type=int, default=3, help="calibrate: rounds of kernel measurements (best kept)")


def _memory_flags(p: argparse.ArgumentParser, searched: bool) -> None:
    """``--mlp-chunk``, ``--loss-chunk``, ``--offload``: fixed values (sim), or fixed instead of searched (plan)."""
    how = "fix it (default: searched, whole or blockwise)" if searched else "default 0: whole"
    p.add_argument("--mlp-chunk", type=int, default=None if searched else 0, metavar="TOKENS",
                   help=f"blockwise MLP: tokens per chunk of the local sequence; {how}")
    p.add_argument("--loss-chunk", type=int, default=None if searched else 0, metavar="TOKENS",
                   help=f"blockwise loss: tokens per chunk of norm + head + cross-entropy; {how}")
    p.add_argument("--offload", default=None if searched else "none", choices=OFFLOAD,
                   help="saved activations in host memory" + ("; fix it (default: searched)" if searched else ""))
    if searched:
        p.add_argument("--offload-optimizer", default=None, choices=("yes", "no"),
                       help="parameters, gradients and AdamW state in host memory with FSDP (CPUOffloadPolicy); fix "
                            "it (default: searched, 'no' under --offload none)")
    else:
        p.add_argument("--offload-optimizer", action="store_true",
                       help="with --fsdp: parameters, gradients and AdamW state in host memory, AdamW on the CPU")
    p.add_argument("--head-chunks", type=int, default=None if searched else 1, metavar="G",
                   help="the attention over G groups of heads, one after another"
                        + ("; fix it (default: searched, 1 or one group per kv head)" if searched else " (default 1)"))


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    _common(p, False)
    _memory_flags(p, searched=True)
    p.add_argument("--max-seq-len", action="store_true", help="per strategy, the longest sequence that fits")
    p.add_argument("--top", type=int, default=15, help="rows of the table (all of them with --json)")
    p.add_argument("--verify", type=int, nargs="?", const=3, default=None, metavar="K",
                   help="dry-run the K best plans (default 3; `burstattn train --dry-run`) and print the predicted "
                        "peak beside the dry run's, term by term")


def _hw(ns):
    from ..sim.hardware import load

    return load(ns.cluster).with_overrides(inter_gbps=ns.inter_gbps, intra_gbps=ns.intra_gbps,
                                           gpu_tflops=ns.gpu_tflops, gpu_mem_gib=ns.gpu_mem_gib)


def degrees(strategy: str, gpus: int, cp, tp, dp) -> tuple[int, int, int]:
    """``(cp, tp, dp)``: missing degrees get 1, except the strategy's own dimension (cp, or tp for
    tp-v1 / tp-v3), which takes what is left of ``gpus``. Raises ``ValueError`` when they do not
    multiply to ``gpus``."""
    _check_gpus(gpus)
    own = _OWN_DIM.get(strategy, "cp")
    given = {"cp": cp, "tp": tp, "dp": dp}
    rest = [k for k, v in given.items() if v is None]
    fixed = 1
    for v in given.values():
        fixed *= v if v is not None else 1
    if rest:
        fill = own if own in rest else "dp" if "dp" in rest else rest[0]
        if gpus % fixed:
            raise ValueError(f"degrees --cp {cp} --tp {tp} --dp {dp}: their product ({fixed}) does not divide --gpus "
                             f"{gpus}; the degrees must multiply to the GPU count")
        for k in rest:
            given[k] = gpus // fixed if k == fill else 1
    if given["cp"] * given["tp"] * given["dp"] != gpus:
        raise ValueError(f"degrees cp={given['cp']} x tp={given['tp']} x dp={given['dp']} = "
                         f"{given['cp'] * given['tp'] * given['dp']}: the degrees must multiply to the GPU count "
                         f"(--gpus {gpus})")
    return given["cp"], given["tp"], given["dp"]


def _check_gpus(gpus) -> None:
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"--gpus must be a positive int, got {gpus!r}")


def run_sim(ns) -> int:
    from ..config import torch_dtype
    from ..models.config import preset as model_preset
    from ..sim.step import SimConfig, simulate

    try:
        if ns.action == "calibrate":
            return _calibrate(ns)
        if ns.seq_len is None:
            raise ValueError("--seq-len is required")
        hw = _hw(ns)
        cp, tp, dp = degrees(ns.strategy, ns.gpus, ns.cp, ns.tp, ns.dp)
        cfg = SimConfig(model_preset(ns.model), ns.seq_len, hw, ns.strategy, ns.mode, cp=cp, tp=tp, dp=dp,
                        batch=ns.batch, layout=ns.layout, schedule=ns.schedule, checkpointing=ns.checkpointing,
                        fsdp=ns.fsdp, causal=not ns.non_causal, ulysses_degree=ns.ulysses_degree,
                        window=ns.window, mlp_chunk=ns.mlp_chunk, loss_chunk=ns.loss_chunk, offload=ns.offload,
                        dtype=torch_dtype(ns.dtype), offload_optimizer=ns.offload_optimizer, head_chunks=ns.head_chunks)
        res = simulate(cfg)
    except ValueError as e:
        print(f"burstattn sim: {e}", file=sys.stderr)
        return 2
    out = {"model": ns.model, "seq_len": ns.seq_len, "gpus": ns.gpus, "cluster": hw.name, "strategy": ns.strategy,
           "mode": ns.mode, "degrees": {"dp": dp, "cp": cp, "tp": tp}, **res.to_dict()}
    no_plot = ""
    if ns.timeline:
        from ..sim.timeline import plot_timeline

        try:
            plot_timeline(res.layer_events, ns.timeline,
                          f"{ns.model}, one layer: {ns.strategy} cp={cp} tp={tp}, N={ns.seq_len}, {hw.name}")
            out["timeline"] = ns.timeline
        except ImportError:  # the base install has no matplotlib: the result still stands
            no_plot = f"--timeline {ns.timeline} needs matplotlib: pip install 'burstattn[bench]' for the picture"
    if ns.json:
        print(json.dumps(out))
        if no_plot:
            print(f"burstattn sim: {no_plot}", file=sys.stderr)
        return 0
    print(f"{ns.model} {ns.mode} {ns.dtype}, N={ns.seq_len}, global batch {ns.batch}, {ns.gpus} x {hw.name}: {ns.strategy} "
          f"dp={dp} cp={cp} tp={tp}"
          + (f", checkpointing {ns.checkpointing}{', FSDP' if ns.fsdp else ''}, mlp chunk {ns.mlp_chunk}, loss chunk "
             f"{ns.loss_chunk}, offload {ns.offload}" if ns.mode == "train" else ""))
    print(f"  time {seconds(res.time_s)} = compute {seconds(res.compute_s)} + exposed comm "
          f"{seconds(res.exposed_comm_s)} + idle {seconds(res.idle_s)}; {rate(res.tokens_per_s)} tokens/s")
    from ..sim.memory import HEADROOM

    print(f"  peak memory {size(res.peak_memory_bytes)} of {size(hw.mem_bytes)} (at most {size(res.memory.usable)}: "
          f"{HEADROOM:.0%} headroom): "
          f"{'fits' if res.fits else 'DOES NOT FIT'} ({', '.join(f'{k} {size(v)}' for k, v in res.memory.to_dict().items() if isinstance(v, int))})")
    if res.memory.phase:
        print(f"  peak in the {res.memory.phase}; largest term: {res.memory.binding()}"
              + (f"; host memory {size(res.memory.host)} of {size(hw.host_mem_bytes)}" if res.memory.host else ""))
    if no_plot:
        print(f"  {no_plot}")
    elif ns.timeline:
        print(f"  wrote {ns.timeline}")
    return 0


def _calibrate(ns) -> int:
    from ..sim.calibrate import calibrate, cluster_section
    from ..sim.hardware import save

    if ns.seconds <= 0 or ns.rounds < 1:
        raise ValueError(f"--seconds must be positive and --rounds at least 1, got {ns.seconds} and {ns.rounds}")
    print(f"burstattn sim calibrate: measuring this machine, about {ns.rounds * 10 * ns.seconds + 5:.0f} s "
          f"(--rounds {ns.rounds} x --seconds {ns.seconds} per kernel figure)", file=sys.stderr, flush=True)
    cal = calibrate(seconds=ns.seconds, rounds=ns.rounds,
                    progress=lambda text: print(f"  {text}", file=sys.stderr, flush=True))
    save(cal.hw, ns.out, {"cluster": cluster_section(cal), "rates": cal.rates, "link": cal.link})
    r, link = cal.rates, cal.link
    print(f"attention fwd {r['attn_fwd'] / 1e9:.1f} GFLOP/s, bwd {r['attn_bwd'] / 1e9:.1f}, matmul "
          f"{r['matmul'] / 1e9:.1f}, memory {r['mem_bw'] / 1e9:.2f} GB/s; gloo p2p {link['bandwidth'] / 1e9:.2f} GB/s, "
          f"{link['latency_s'] * 1e6:.0f} us -> wrote {ns.out} (--cluster {ns.out}; "
          f"burstattn cluster up --cluster-spec {ns.out})")
    return 0


def _verified(ns, rows) -> int:
    """``--verify``: dry-run the first K plans and print (or ``--json``: ``{"verified": [...]}``) them."""
    from ..train.dryrun import DryRunError
    from .verify import format_verified, verify_rows

    try:
        done = verify_rows(rows, ns.verify, rows[0]["capacity_bytes"] if rows else None)
    except (ValueError, DryRunError) as e:
        print(f"burstattn plan --verify: {e}", file=sys.stderr)
        return 2 if isinstance(e, ValueError) else 1
    print(json.dumps({"verified": done}) if ns.json else format_verified(done))
    return 0


def run_planner(ns) -> int:
    from ..config import torch_dtype
    from ..models.config import preset as model_preset
    from ..sim.feasible import nothing_runs
    from ..sim.planner import MemoryChoice, excluded, max_seq_len, plan

    try:
        _check_gpus(ns.gpus)
        hw, model = _hw(ns), model_preset(ns.model)
        fixed = MemoryChoice(ns.mlp_chunk, ns.loss_chunk, ns.offload, dtype=torch_dtype(ns.dtype),
                             offload_optimizer=None if ns.offload_optimizer is None else ns.offload_optimizer == "yes",
                             head_chunks=ns.head_chunks)
        for flag in ("mlp_chunk", "loss_chunk"):
            if getattr(ns, flag) is not None and getattr(ns, flag) < 0:
                raise ValueError(f"--{flag.replace('_', '-')} must be a non-negative int (0: whole), got {getattr(ns, flag)}")
        if ns.verify is not None and (ns.verify < 1 or ns.mode != "train"):
            raise ValueError(f"--verify takes K >= 1 plans of --mode train, got K={ns.verify}, mode {ns.mode}")
        if ns.max_seq_len:
            res = max_seq_len(model, ns.gpus, hw, ns.mode, ns.batch, fixed=fixed)
            if ns.verify:  # only lengths a dry run confirms fit, with headroom (.verify_len)
                from .verify_len import confirm_lengths, format_confirmed
                from ..sim.step import host_capacity
                done = confirm_lengths(res, ns.verify, lambda n: plan(
                    model, n, ns.gpus, hw, ns.mode, ns.batch, model_name=ns.model, fixed=fixed), hw.mem_bytes,
                    host_capacity=host_capacity(hw, ns.gpus))
                print(json.dumps({"confirmed": done}) if ns.json else format_confirmed(done, hw.mem_bytes))
                return 0
            if ns.json:
                print(json.dumps({"max_seq_len": {k: v["tokens"] for k, v in res.items()},
                                  "degrees": {k: v["degrees"] for k, v in res.items()},
                                  "options": {k: v["options"] for k, v in res.items()},
                                  "binding": {k: v["binding"] for k, v in res.items()},
                                  "host_memory_bytes": {k: v["host_memory_bytes"] for k, v in res.items()}}))
                return 0
            searched = ["checkpointing", "FSDP"] + (["blockwise chunks"] if ns.mlp_chunk is None or ns.loss_chunk is None
                                                    else []) \
                + (["offload"] if ns.offload is None and not hw.host_is_device else []) \
                + (["optimizer offload"] if ns.offload_optimizer is None and ns.offload != "none"
                   and not hw.host_is_device else []) \
                + (["head chunks"] if ns.head_chunks is None else [])
            given = [f"--{k.replace('_', '-')} {getattr(ns, k)}" for k in ("mlp_chunk", "loss_chunk", "offload",
                                                                           "offload_optimizer", "head_chunks")
                     if getattr(ns, k) is not None]
            print(f"longest sequence that fits, {ns.model} {ns.mode}, global batch {ns.batch}, on {ns.gpus} x {hw.name} ("
                  + (", ".join(searched) + " searched" + (f"; {' '.join(given)}" if given else "")
                     if ns.mode == "train" else "weights + KV cache") + "):")
            for k, v in sorted(res.items(), key=lambda kv: -kv[1]["tokens"]):
                d, o = v["degrees"], v["options"]
                print(f"  {k:20s} {v['tokens']:>12,} tokens  (dp={d['dp']} cp={d['cp']} tp={d['tp']}"
                      + (f", {o['checkpointing']}, chunks {o['mlp_chunk']}/{o['loss_chunk']}, offload {o['offload']}"
                         + (", optimizer on host" if o.get("offload_optimizer") else "")
                         + (f", head chunks {o['head_chunks']}" if o.get("head_chunks", 1) > 1 else "")
                         if ns.mode == "train" else "")
                      + (f"; host {size(v['host_memory_bytes'])}" if v.get("host_memory_bytes") else "")
                      + f"; binds: {v['binding']})")
            return 0
        if ns.seq_len is None:
            raise ValueError("--seq-len is required (or --max-seq-len)")
        rows = plan(model, ns.seq_len, ns.gpus, hw, ns.mode, ns.batch, model_name=ns.model, fixed=fixed)
        out = excluded(model, ns.seq_len, ns.gpus, hw, ns.mode, ns.batch)
    except ValueError as e:
        print(f"burstattn plan: {e}", file=sys.stderr)
        return 2
    if ns.verify:
        return _verified(ns, rows)
    if ns.json:
        print(json.dumps({"ranking": rows, "excluded": [x.to_dict() for x in out]}))
        return 0
    if not rows:
        print(nothing_runs(ns.gpus, ns.seq_len, out))
        return 0
    print(f"{ns.model} {ns.mode}, N={ns.seq_len}, global batch {ns.batch} ({ns.batch * ns.seq_len:,} tokens per step), "
          f"{ns.gpus} x {hw.name}: {len(rows)} configurations, by time per token")
    print(f"{'#':>3} {'strategy':18s} {'dp':>4} {'cp':>4} {'tp':>3} {'ckpt':5s} {'fsdp':4s} {'chunks':>11s} {'offload':7s} "
          f"{'step time':>10s} {'tokens/s':>9s} {'memory':>10s}  why")
    for i, r in enumerate(rows[:ns.top]):
        d = r["degrees"]
        chunks = f"{r['mlp_chunk']}/{r['loss_chunk']}" if r["mlp_chunk"] or r["loss_chunk"] else "whole"
        print(f"{i + 1:>3} {r['strategy']:18s} {d['dp']:>4} {d['cp']:>4} {d['tp']:>3} {r['checkpointing']:5s} "
              f"{'yes' if r['fsdp'] else 'no':4s} {chunks:>11s} {r['offload']:7s} {seconds(r['time_s']):>10s} "
              f"{rate(r['tokens_per_s']):>9s} {size(r['peak_memory_bytes']):>10s}  {r['why']}")
    if rows and rows[0]["fits"]:
        cfg = rows[0]["config"]
        lines = [cfg[k] for k in ("train", "attention") if k in cfg] + ([f"({cfg['note']})"] if "note" in cfg else [])
        print("\nrun the winner with:\n" + "\n".join(f"  {line}" for line in lines))
    else:
        print("\nnothing fits: add devices, shorten the sequence, or use a larger-memory cluster")
    return 0

"""The recurrent layers' state passing at large cp: the all-gather against the log-depth scan, per layer
and rank (batch 1, float32 summaries, zigzag, one document per row): bytes and rounds by formula
(burstattn.recurrent.state_passing_bytes / state_passing_steps, metered equal in tests/dist), the memory
a rank keeps for the backward and the time on a cluster preset (burstattn.sim.recurrent), for
hybrid-small's and Qwen3-Next-80B's Gated DeltaNet shapes. Prints markdown tables.

With --dry-run CP [CP ...] it also runs `burstattn train --dry-run` of hybrid-small at each cp with the
scan and with the all-gather (the scheme forced through the module's threshold: a measurement, not an
option of the library) and prints the peaks' difference against the simulator's terms.

    python -m bench.scripts.hybrid_cp_scan [--cluster h100-nvlink-ib] [--dry-run 8 32 64]
"""
from __future__ import annotations

import argparse

MIB = 2 ** 20


def simulated(cluster: str, cps: list) -> list:
    from burstattn.recurrent import state_passing_bytes, state_passing_steps
    from burstattn.sim import recurrent as sr
    from burstattn.sim.hardware import preset

    hw = preset(cluster)
    layers = {"hybrid-small": 3, "qwen3-next-80b": 36}
    lines = [f"| shape (layers) | cp | scheme | bytes sent per layer, fwd + bwd | rounds | kept per layer | "
             f"kept, all layers | time per layer ({cluster}) |", "|---|---:|---|---:|---:|---:|---:|---:|"]
    for name, s in sr.REFERENCE.items():
        for cp in cps:
            for scheme in ("allgather", "scan"):
                kw = dict(batch=s.batch, heads=s.heads, dk=s.dk, dv=s.dv, matrix=True, scheme=scheme)
                b = state_passing_bytes(2 * cp, cp, "zigzag", **kw)
                steps = state_passing_steps(2 * cp, cp, "zigzag", scheme=scheme)["forward"]
                kept = sr.passing_memory(s, cp, scheme)
                t = sr.passing_time(s, cp, hw, scheme)
                lines.append(f"| {name} ({layers[name]}) | {cp} | {scheme} | {(b['forward'] + b['backward']) / MIB:,.1f} MiB "
                             f"| {steps} | {kept / MIB:,.1f} MiB | {layers[name] * kept / 2**30:,.2f} GiB | "
                             f"{t * 1e3:.2f} ms |")
    thresholds = {n: sr.scan_threshold(s, hw) for n, s in sr.REFERENCE.items()}
    lines.append(f"\nScan no slower from cp: {thresholds} on {cluster}; scheme=\"auto\" takes it from "
                 f"{sr.derived_min_world(hw)} (burstattn.recurrent.SCAN_MIN_WORLD).")
    return lines


def dry_runs(cps: list, seq_per_rank: int) -> list:
    import burstattn.recurrent.schemes as schemes
    from burstattn.models import preset
    from burstattn.sim import recurrent as sr
    from burstattn.train.config import TrainConfig
    from burstattn.train.dryrun import dry_run

    m = preset("hybrid-small")
    lines = ["| cp | dry-run peak, all-gather | dry-run peak, scan | difference | simulator's difference |",
             "|---:|---:|---:|---:|---:|"]
    for cp in cps:
        peaks = {}
        for scheme, threshold in (("allgather", 10 ** 9), ("scan", 2)):
            schemes.SCAN_MIN_WORLD = threshold  # the measurement forces the scheme through "auto"
            cfg = TrainConfig(model="hybrid-small", seq_len=seq_per_rank * cp, batch=1, steps=1, cp=cp, dp=1, tp=1)
            peaks[scheme] = dry_run(cfg, cp)["peak_bytes"]
        model = sum(sr.kept_bytes(m, batch=1, cp=cp, scheme="allgather")) - sum(sr.kept_bytes(m, batch=1, cp=cp,
                                                                                              scheme="scan"))
        lines.append(f"| {cp} | {peaks['allgather'] / MIB:.1f} MiB | {peaks['scan'] / MIB:.1f} MiB | "
                     f"{(peaks['allgather'] - peaks['scan']) / MIB:.1f} MiB | {model / MIB:.1f} MiB |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cluster", default="h100-nvlink-ib")
    ap.add_argument("--cp", type=int, nargs="+", default=[8, 64, 128, 256])
    ap.add_argument("--dry-run", type=int, nargs="*", default=[])
    ap.add_argument("--seq-per-rank", type=int, default=64)
    args = ap.parse_args()
    print("\n".join(simulated(args.cluster, args.cp)))
    if args.dry_run:
        print()
        print("\n".join(dry_runs(args.dry_run, args.seq_per_rank)))


if __name__ == "__main__":
    main()

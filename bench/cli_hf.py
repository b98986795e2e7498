"""``burstattn bench hf``: its flags and handler (Trainer steps with and without context parallelism)."""
from __future__ import annotations

import argparse
import dataclasses
import sys


def run_hf(ns: argparse.Namespace) -> int:
    """``burstattn bench hf``: Trainer steps with and without context parallelism (needs ``burstattn[hf]``)."""
    from burstattn.cli.generate_run import missing_transformers

    if missing_transformers():
        print("burstattn bench hf: needs transformers and accelerate: pip install 'burstattn[hf]'", file=sys.stderr)
        return 2
    from bench import hf
    from bench.hf_report import hf_markdown

    print(hf_markdown(hf.run_hf_bench(hf_config(ns), docs=ns.docs)))
    return 0


def add_hf_arguments(p: argparse.ArgumentParser) -> None:
    from bench.hf import CONTENDERS, SUITES, HfBenchConfig

    d = HfBenchConfig()
    p.add_argument("--world-size", type=int, default=d.world_size)
    p.add_argument("--seq-lens", nargs="+", type=int, default=list(d.seq_lens), help="tokens of one packed row")
    p.add_argument("--contenders", nargs="+", default=list(d.contenders), choices=CONTENDERS)
    p.add_argument("--steps", type=int, default=d.steps, help="timed optimizer steps (after --warmup)")
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--mem-budget-mib", type=float, default=d.mem_budget_mib, help="per-rank budget of the maxlen suite")
    p.add_argument("--maxlen-cap", type=int, default=d.maxlen_cap)
    p.add_argument("--suites", nargs="+", default=list(d.suites), choices=SUITES)
    p.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    p.add_argument("--out", default=d.out)
    p.add_argument("--docs", default=None, metavar="FILE", help="also write the tables into this Markdown file "
                                                              "(between its bench hf markers)")


def hf_config(ns: argparse.Namespace):
    from bench.hf import HfBenchConfig

    cfg = dataclasses.replace(HfBenchConfig(), world_size=ns.world_size, seq_lens=tuple(ns.seq_lens),
                              contenders=tuple(ns.contenders), steps=ns.steps, warmup=ns.warmup,
                              mem_budget_mib=ns.mem_budget_mib, maxlen_cap=ns.maxlen_cap, suites=tuple(ns.suites),
                              out=ns.out)
    if ns.quick:
        cfg = dataclasses.replace(cfg, seq_lens=(256,), steps=1, warmup=0, hidden=64, heads=4, kv_heads=2, vocab=256,
                                  mean_doc=64, mem_budget_mib=24.0, maxlen_start=256, maxlen_cap=1024, granule=256,
                                  bisect_steps=0, balance_seq_len=4096, balance_world_sizes=(2, 4), block_size=128)
    return cfg

"""``burstattn demo``: flags and handler (the job itself is :mod:`burstattn.cli.demo_run`)."""
from __future__ import annotations

import argparse

HELP = "run and check burst attention on a long sequence over local ranks"


def add(sub: argparse._SubParsersAction) -> None:
    """Add ``burstattn demo`` to the subcommands ``sub``."""
    from . import demo_run as demo

    p = sub.add_parser("demo", help=HELP, description=demo.__doc__.split("\n\n")[0] if demo.__doc__ else None)
    add_demo_arguments(p)
    p.set_defaults(handler=run)


def run(ns: argparse.Namespace) -> int:
    from . import demo_run as demo

    return demo.run_demo(demo_config(ns))


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    """The demo's flags (defaults from :class:`DemoConfig`)."""
    from .demo_run import DemoConfig
    from ..config import LOW_DTYPES

    d = DemoConfig()
    p.add_argument("--world-size", type=int, default=d.world_size, help="local ranks to spawn")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="global sequence length")
    p.add_argument("--heads", type=int, default=d.heads, help="query heads")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: --heads)")
    p.add_argument("--head-dim", type=int, default=d.head_dim)
    p.add_argument("--batch", type=int, default=d.batch)
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=d.causal)
    p.add_argument("--layout", choices=("contiguous", "zigzag", "striped"), default=d.layout)
    p.add_argument("--dtype", choices=LOW_DTYPES, default=d.dtype)
    p.add_argument("--backend", choices=("auto", "reference", "cpu_flash", "sdpa", "flash_attn"),
                   default=d.backend)
    p.add_argument("--backward", choices=("auto", "burst", "kv"), default=d.backward,
                   help="backward ring: burst (query ring) or kv (RingAttention); auto picks fewer bytes")
    p.add_argument("--threads-per-rank", type=int, default=None, help="default: max(1, cores // world size)")
    p.add_argument("--check-rows", type=int, default=d.check_rows, help="query rows checked in float64")
    p.add_argument("--repeats", type=int, default=d.repeats, help="timed repeats (median reported)")
    p.add_argument("--warmup", type=int, default=d.warmup,
                   help="extra untimed calls before timing (the first, checked call already warms up)")
    p.add_argument("--seed", type=int, default=d.seed)


def demo_config(ns: argparse.Namespace) -> DemoConfig:
    """A :class:`DemoConfig` from parsed flags."""
    from .demo_run import DemoConfig

    return DemoConfig(**{f: getattr(ns, f) for f in DemoConfig.__dataclass_fields__})

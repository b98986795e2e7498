"""``burstattn bench grid``: every strategy and peer over a grid of shapes, in real processes.

A config file (TOML, :class:`GridConfig`; flags override it) names contenders x sequence lengths x
world sizes x causal x dtypes. One :class:`~burstattn.testing.launch.LocalPool` per world size (threads set
with ``torch.set_num_threads(threads_per_rank)`` in every rank; ranks x threads must not exceed the
cores); every point is one ``pool.run``, so a point that fails costs only itself. Per point, in
every rank:

1. correctness first: the same contender on a small instance of the same config (``check_seq_len``
   tokens, same heads/dtype/causal/layout), output and dQ/dK/dV against the float64
   :mod:`burstattn.testing.oracle` on the global tensors, as ``max|x - ref| / max|ref|`` over every rank's rows;
2. bytes per rank: one forward and one forward+backward under :func:`.distmeter.dist_meter` (which wraps
   ``torch.distributed`` and so counts the peers too) and, for burstattn's strategies,
   :func:`burstattn.comm_stats` (the two must agree), next to the contender's formula;
3. peak memory per rank of those two calls (:mod:`.memory`, the allocator's events; they are the warm-up);
4. forward and forward+backward time: ``warmup`` more calls, then ``repeats`` timed ones, alternated;
   the time of a repeat is the slowest rank's, the record keeps the median.

The parent measures what other processes used meanwhile (:func:`.timing.other_load`) and reruns a
point once when that exceeded ``busy_cores``.
"""
from __future__ import annotations

import os
import statistics
from dataclasses import asdict, dataclass, field, fields
from typing import Optional

import torch
import torch.distributed as dist

from burstattn.config import torch_dtype
from burstattn.meter.progress import ProgressFile
from burstattn.meter.timing import time_interleaved

OURS = ("burst", "ring", "rsa", "ulysses", "allgather", "usp", "tp", "burst-distflash", "burst-double")
LAYOUT_OF = {"burst": "zigzag", "usp": "zigzag", "burst-distflash": "contiguous",
             "burst-double": "zigzag"}  # else contiguous


@dataclass(frozen=True)
class GridConfig:
    """A grid run (a TOML file's keys are these field names)."""

    contenders: tuple[str, ...] = OURS       # ours by name; peers as "peer:variant" (torch_cp:allgather, ...)
    seq_lens: tuple[int, ...] = (8192,)
    world_sizes: tuple[int, ...] = (2,)
    causal: tuple[bool, ...] = (False, True)
    dtypes: tuple[str, ...] = ("float32",)
    heads: int = 8
    kv_heads: int = 8
    head_dim: int = 64
    batch: int = 1
    threads_per_rank: int = 1
    repeats: int = 3
    warmup: int = 0                          # extra untimed calls (the byte/memory calls already warm up)
    check_seq_len: int = 1024                # correctness instance
    usp_ulysses_degree: int = 2              # capped at the world size
    max_seq: dict = field(default_factory=dict)  # contender -> longest seq_len to run (e.g. rsa's O(n N) memory)
    busy_cores: float = 0.1                  # rerun a point once if other processes used more than this
    out: str = "bench-out"
    name: str = "grid"                       # output file stem

    @staticmethod
    def load(path: Optional[str], **overrides) -> "GridConfig":
        """From a TOML file (unknown keys raise ValueError), then ``overrides`` (``None`` values ignored)."""
        data = {}
        if path:
            try:
                import tomllib  # Python >= 3.11
            except ImportError as e:  # Python 3.10: the tomli backport has the same API
                try:
                    import tomli as tomllib
                except ImportError:
                    raise ImportError("reading a TOML config on Python 3.10 needs `pip install tomli`") from e
            with open(path, "rb") as f:
                data = tomllib.load(f)
        names = {f.name for f in fields(GridConfig)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"{path}: unknown key(s) {unknown}; known: {sorted(names)}")
        data.update({k: v for k, v in overrides.items() if v is not None})
        data = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
        cfg = GridConfig(**data)
        if max(cfg.world_sizes) * cfg.threads_per_rank > (os.cpu_count() or 1):
            print(f"warning: {max(cfg.world_sizes)} ranks x {cfg.threads_per_rank} threads exceed "
                  f"{os.cpu_count()} cores: timings will be oversubscribed")
        return cfg


@dataclass(frozen=True)
class GridPoint:
    contender: str
    seq_len: int
    causal: bool
    dtype: str
    heads: int
    kv_heads: int
    head_dim: int
    batch: int
    repeats: int
    warmup: int
    check_seq_len: int
    usp_ulysses_degree: int


# ------------------------------------------------------------------------------ rank side
def _ours(name: str, p: GridPoint, world: int, group):
    from burstattn.api import burst_attn_func
    from burstattn.layouts.named import local_positions
    from burstattn.strategies import STRATEGIES, attention
    from burstattn.strategies.usp import usp_positions
    from bench.peers import Contender, PeerUnavailable

    layout = LAYOUT_OF.get(name, "contiguous")
    positions = lambda s, r, w: local_positions(s, r, w, layout)  # noqa: E731
    opts: dict = {}
    if name == "burst-distflash":
        if not p.causal:
            raise PeerUnavailable("schedule='distflash' is causal-only")
        fn = lambda q, k, v: burst_attn_func(q, k, v, causal=True, layout=layout, schedule="distflash")  # noqa: E731

        def formula(rank, **kw):
            from burstattn.engine.bytes import distflash_bytes
            return distflash_bytes(rank=rank, **kw)
        return Contender(name, fn, positions, "ring", formula, ours=True)
    if name == "burst-double":  # two-level ring: ranks_per_node = usp_ulysses_degree (the node size)
        from burstattn.engine.bytes import choose_backward, double_bytes
        from burstattn.comm.groups import two_level_groups
        per_node = min(p.usp_ulysses_degree, world)
        topo = two_level_groups(per_node)
        fn = lambda q, k, v: burst_attn_func(q, k, v, causal=p.causal, layout=layout, schedule="double",  # noqa: E731
                                             topology=topo)

        def formula(rank, **kw):
            return double_bytes(ranks_per_node=per_node, backward=choose_backward(**kw), **kw)
        return Contender(name, fn, positions, "ring", formula, ours=True)
    if name == "usp":
        u = min(p.usp_ulysses_degree, world)
        opts = dict(ulysses_degree=u, ring_degree=world // u)
        positions = lambda s, r, w: usp_positions(s, ring_rank=r // u, ring_degree=w // u,  # noqa: E731
                                                  ulysses_rank=r % u, ulysses_degree=u, layout=layout)
    fn = lambda q, k, v: attention(q, k, v, strategy=name, causal=p.causal, layout=layout, **opts)  # noqa: E731
    spec_formula = STRATEGIES[name].bytes_formula()
    fopts = {"ulysses_degree": opts["ulysses_degree"], "layout": layout, "causal": p.causal} if name == "usp" else {}
    family = {"ulysses": "a2a", "tp": "gather", "allgather": "gather"}.get(name, "ring")

    def formula(rank, **kw):
        return spec_formula(**kw, **fopts, **({"rank": rank} if name == "usp" else {}))
    return Contender(name, fn, positions, family, formula, ours=True)


def contender(p: GridPoint, world: int):
    from bench.peers import make_peer

    group = dist.group.WORLD
    if ":" in p.contender:
        peer, variant = p.contender.split(":", 1)
        return make_peer(peer, variant, causal=p.causal, group=group)
    if p.contender not in OURS:
        raise ValueError(f"unknown contender {p.contender!r}; ours: {OURS}, peers as 'peer:variant'")
    return _ours(p.contender, p, world, group)


def _global(p: GridPoint, seq_len: int, seed: int):
    """Global q [B, N, Hq, D], k/v [B, N, Hkv, D], dO, in float64 (the same on every rank)."""
    gen = torch.Generator().manual_seed(seed)
    shape_q, shape_kv = (p.batch, seq_len, p.heads, p.head_dim), (p.batch, seq_len, p.kv_heads, p.head_dim)
    return [torch.randn(s, generator=gen, dtype=torch.float64) for s in (shape_q, shape_kv, shape_kv, shape_q)]


def _check(c, p: GridPoint, rank: int, world: int) -> dict:
    """Relative errors of out, dq, dk, dv on this rank's rows vs the float64 reference."""
    from burstattn.testing.oracle import exact_attention

    q, k, v, do = _global(p, p.check_seq_len, 1234)
    ref = [x.clone().requires_grad_() for x in (q, k, v)]
    out_ref = exact_attention(*ref, causal=p.causal)[0]
    out_ref.backward(do)
    pos = c.positions(p.check_seq_len, rank, world)
    dt = torch_dtype(p.dtype)
    loc = [x[:, pos].to(dt).contiguous().requires_grad_() for x in (q, k, v)]
    out = c.fn(*loc)
    out.backward(do[:, pos].to(dt))
    got = {"out": out, "dq": loc[0].grad, "dk": loc[1].grad, "dv": loc[2].grad}
    want = {"out": out_ref, "dq": ref[0].grad, "dk": ref[1].grad, "dv": ref[2].grad}
    errs = {}
    for key, x in got.items():
        w = want[key][:, pos]
        errs[key] = float("inf") if x is None else float((x.detach().double() - w).abs().max() / w.abs().max())
    errs["out_dtype"] = str(out.dtype).replace("torch.", "")
    errs["dq_dtype"] = str(loc[0].grad.dtype).replace("torch.", "") if loc[0].grad is not None else None
    return errs


def _measured(c, fn_fwd, fn_fwd_bwd) -> dict:
    """Bytes (meter and, for ours, comm_stats) and peak memory of one fwd and one fwd+bwd."""
    from burstattn.comm.stats import comm_stats
    from bench.distmeter import dist_meter
    from burstattn.meter.memory import measure_peak

    res = {}
    for name, fn in (("fwd", fn_fwd), ("fwd+bwd", fn_fwd_bwd)):
        dist.barrier()
        with dist_meter() as meter, comm_stats() as stats:
            _, mem = measure_peak(fn)
        res[name] = {"peak": mem.peak_bytes, "sent": meter.sent, "ops": meter.as_dict(),
                     "comm_stats_sent": stats.sent() if c.ours else None}
    return res


def grid_point(rank: int, world: int, p: GridPoint, progress_path: Optional[str]) -> dict:
    """One point on one rank (runs inside the pool)."""
    from bench.peers import PeerUnavailable

    ProgressFile(progress_path, rank).start(f"P={world} {p.contender} N={p.seq_len} "
                                            f"{'causal' if p.causal else 'non-causal'} {p.dtype}")
    rec: dict = {"rank": rank}
    try:
        c = contender(p, world)
    except PeerUnavailable as e:
        return {**rec, "unavailable": str(e)}
    rec["name"], rec["family"], rec["ours"] = c.name, c.family, c.ours
    try:
        rec["errors"] = _check(c, p, rank, world)
    except Exception as e:  # noqa: BLE001 - a peer that cannot run this point is a result
        return {**rec, "failed": f"{type(e).__name__}: {e}"[:500]}
    n, dt = p.seq_len // world, torch_dtype(p.dtype)
    gen = torch.Generator().manual_seed(1000 * rank + 7)
    q = torch.randn(p.batch, n, p.heads, p.head_dim, generator=gen).to(dt).requires_grad_()
    k, v = (torch.randn(p.batch, n, p.kv_heads, p.head_dim, generator=gen).to(dt).requires_grad_() for _ in "kv")
    grad = torch.randn(p.batch, n, p.heads, p.head_dim, generator=gen).to(dt)

    def fwd():
        return c.fn(q, k, v)

    def fwd_bwd():
        q.grad = k.grad = v.grad = None
        c.fn(q, k, v).backward(grad)

    rec["measured"] = _measured(c, fwd, fwd_bwd)
    if c.formula is not None:
        f = c.formula(rank=rank, batch=p.batch, local_seq=n, world_size=world, q_heads=p.heads,
                      kv_heads=p.kv_heads, head_dim=p.head_dim, dtype=dt)
        rec["formula"] = {"fwd": f["forward"], "fwd+bwd": f["forward"] + f["backward"]}
    t = time_interleaved({"fwd": fwd, "fwd+bwd": fwd_bwd}, repeats=p.repeats, warmup=p.warmup, barrier=dist.barrier)
    rec["samples"] = {name: list(x.samples) for name, x in t.items()}
    return rec


# ---------------------------------------------------------------------------- parent side
def grid_points(cfg: GridConfig) -> list[tuple[int, GridPoint]]:
    out = []
    for world in cfg.world_sizes:
        for dtype in cfg.dtypes:
            for seq in cfg.seq_lens:
                for causal in cfg.causal:
                    for name in cfg.contenders:
                        if seq > cfg.max_seq.get(name, seq):
                            continue
                        out.append((world, GridPoint(name, seq, causal, dtype, cfg.heads, cfg.kv_heads,
                                                     cfg.head_dim, cfg.batch, cfg.repeats, cfg.warmup,
                                                     cfg.check_seq_len, cfg.usp_ulysses_degree)))
    return out


def combine(p: GridPoint, world: int, ranks: list[dict]) -> dict:
    """One JSON record from every rank's result."""
    rec = {"contender": p.contender, "world_size": world, "config": asdict(p)}
    first = ranks[0]
    for key in ("unavailable", "failed"):
        if key in first or any(key in r for r in ranks):
            rec[key] = next(r[key] for r in ranks if key in r)
            return rec
    rec.update(name=first["name"], family=first["family"], ours=first["ours"])
    rec["errors"] = {k: max(r["errors"][k] for r in ranks) for k in ("out", "dq", "dk", "dv")}
    rec["dtypes"] = {"out": first["errors"]["out_dtype"], "dq": first["errors"]["dq_dtype"]}
    rec["median_s"] = {ph: statistics.median(max(rep) for rep in zip(*[r["samples"][ph] for r in ranks]))
                       for ph in ("fwd", "fwd+bwd")}
    rec["samples_s"] = {ph: [r["samples"][ph] for r in ranks] for ph in ("fwd", "fwd+bwd")}
    m = [r["measured"] for r in ranks]
    rec["peak_bytes"] = {ph: max(x[ph]["peak"] for x in m) for ph in ("fwd", "fwd+bwd")}
    rec["sent_bytes"] = {ph: max(x[ph]["sent"] for x in m) for ph in ("fwd", "fwd+bwd")}
    rec["sent_bytes_per_rank"] = {ph: [x[ph]["sent"] for x in m] for ph in ("fwd", "fwd+bwd")}
    rec["sent_ops"] = m[0]["fwd+bwd"]["ops"]
    if first["ours"]:
        cs = [x["fwd+bwd"]["comm_stats_sent"] for x in m] + [x["fwd"]["comm_stats_sent"] for x in m]
        rec["comm_stats_agrees"] = cs == rec["sent_bytes_per_rank"]["fwd+bwd"] + rec["sent_bytes_per_rank"]["fwd"]
    if "formula" in first:
        rec["formula_bytes"] = {ph: max(r["formula"][ph] for r in ranks) for ph in ("fwd", "fwd+bwd")}
    return rec


def run_grid(cfg: GridConfig, *, docs: Optional[str] = None, console=None) -> list[dict]:
    """Run the grid; write ``<out>/<name>.json`` and ``.md``; return the records."""
    from rich.console import Console

    from bench.driver import Pools, Started, document, publish, run_points
    from bench.report import grid_markdown, ratios_markdown

    console = console or Console()
    points = grid_points(cfg)
    started = Started.now()
    console.print(f"bench grid: {len(points)} points, {cfg.threads_per_rank} thread(s) per rank "
                  f"(torch.set_num_threads in every rank), {os.cpu_count()} cores")
    with Pools(timeout_s=3600.0, pg_timeout_s=600.0) as pools:
        records = run_points("bench grid", points, grid_point, combine, failed, pools=pools,
                             threads=cfg.threads_per_rank, console=console, busy_cores=cfg.busy_cores)
    doc = document("grid", cfg, started, records=records, versions=_versions(),
                   threads=f"torch.set_num_threads({cfg.threads_per_rank}) in every rank (LocalPool threads_per_rank)")
    md = grid_markdown(doc) + "\n#### burst against each peer\n\n" + ratios_markdown(doc)
    publish(cfg.out, cfg.name, doc, md, console=console)
    return records


def failed(p: GridPoint, world: int, text: str) -> dict:
    """The record of a point whose ranks raised."""
    return {"contender": p.contender, "world_size": world, "config": asdict(p), "failed": text}


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("torch", "burstattn", "deepspeed", "yunchang", "matplotlib"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out

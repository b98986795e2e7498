"""``burstattn bench masks``: sliding windows, packed documents and load balance, in real processes.

Suites (select with ``--suites``):

* ``masks`` (P = ``world_size`` ranks, N = ``seq_len``, causal): dense causal zigzag (the baseline),
  dense causal contiguous, a causal sliding window of N/8 keys (contiguous layout), and
  ``documents`` packed documents (cut points from a fixed seed, :func:`.mask_points.packed_documents`) over the
  contiguous, zigzag and :func:`burstattn.layouts.partition.document_partition` layouts. Target: the
  window at most 1/3 of the dense causal time (fwd+bwd); time and bytes about in proportion to
  the useful work (visible (q, k) pairs).
* ``distflash`` (every P of ``distflash_world_sizes``, N = ``distflash_seq_len``): the causal ring
  over contiguous (unbalanced), zigzag and striped, ``schedule="distflash"``, and the non-causal
  ring. Target: DistFlashAttn's causal time <= 0.6x the non-causal time (fwd+bwd).

Per point, in every rank (one :class:`~burstattn.testing.launch.LocalPool` per world size, one
``pool.run`` per point, so a failing point costs only itself):

1. correctness: the same point on ``check_seq_len`` tokens (same mask shape, layout, schedule),
   out / dQ / dK / dV of every rank's rows against the float64 dense reference with the mask;
2. bytes: one forward and one forward+backward under :func:`burstattn.comm_stats`, per
   (phase, op), next to the formula (``mask_bytes`` / ``ring_bytes`` / ``distflash_bytes``);
3. the full-size result itself: out and dQ of ``check_rows`` sampled rows of every rank (from the
   forward+backward of step 2) against float64 (dQ of a row depends only on that row);
4. time: ``warmup`` more calls, then ``repeats`` alternated fwd / fwd+bwd calls; a repeat's time
   is the slowest rank's, the record keeps the median.

The balance figure is max over mean of the score entries each rank computes under the plan
actually run (:func:`burstattn.engine.plan.plan_cost` of each rank's plan); the useful work counts
the visible (q, k) pairs of the mask.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace
from typing import Optional

import torch
import torch.distributed as dist

from bench.mask_points import MaskPoint, point_layout, point_mask
from burstattn.config import torch_dtype
from burstattn.layouts.named import local_positions
from burstattn.meter.progress import ProgressFile
from burstattn.meter.timing import time_interleaved

SUITES = ("masks", "distflash")


@dataclass(frozen=True)
class MasksConfig:
    """Flags of ``burstattn bench masks``."""

    out: str = "bench-out"                      # directory for masks.json and masks.md
    docs: Optional[str] = None                  # also write the section into this file (bench/results/masks.md)
    quick: bool = False                         # tiny sizes, 1 repeat: a smoke run
    suites: tuple[str, ...] = SUITES
    world_size: int = 4                         # masks suite
    seq_len: int = 32768                        # masks suite
    distflash_world_sizes: tuple[int, ...] = (4, 8)
    distflash_seq_len: int = 16384
    heads: int = 8
    kv_heads: int = 8
    head_dim: int = 64
    batch: int = 1
    dtype: str = "float32"
    window_div: int = 8                         # the window sees seq_len // window_div keys to the left
    documents: int = 8                          # packed documents of the masks suite
    doc_seed: int = 0                           # seed of their cut points
    repeats: int = 3
    warmup: int = 0                             # extra untimed calls (the byte calls already warm up)
    check_seq_len: int = 1024                   # correctness instance (full fwd+bwd vs float64)
    check_rows: int = 8                         # sampled rows per rank checked at full size

    def effective(self) -> "MasksConfig":
        """The configuration actually run (``quick``: N = 1024, P <= 4, 1 repeat)."""
        unknown = sorted(set(self.suites) - set(SUITES))
        if unknown:
            raise ValueError(f"unknown suite(s) {unknown}; known: {list(SUITES)}")
        if not self.quick:
            return self
        worlds = tuple(w for w in self.distflash_world_sizes if w <= 4) or (4,)
        return replace(self, seq_len=min(self.seq_len, 1024), distflash_seq_len=min(self.distflash_seq_len, 1024),
                       distflash_world_sizes=worlds, repeats=1, warmup=0,
                       check_seq_len=min(self.check_seq_len, 512), check_rows=min(self.check_rows, 4))


# ------------------------------------------------------------------------------ rank side
def _global(p: MaskPoint, seq_len: int, seed: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Global q [B, N, Hq, D], k/v [B, N, Hkv, D], dO [B, N, Hq, D] (equal on every rank)."""
    gen = torch.Generator().manual_seed(seed)
    sq, skv = (p.batch, seq_len, p.heads, p.head_dim), (p.batch, seq_len, p.kv_heads, p.head_dim)
    return [torch.randn(s, generator=gen, dtype=dtype) for s in (sq, skv, skv, sq)]


def _call(p: MaskPoint, seq_len: int, world: int):
    """``fn(q, k, v) -> out`` for the point at ``seq_len`` tokens, and the layout it uses."""
    from burstattn import burst_attn_func

    layout, mask = point_layout(p, seq_len, world), point_mask(p, seq_len)
    return (lambda q, k, v: burst_attn_func(q, k, v, causal=p.causal, layout=layout,  # noqa: E731
                                            schedule=p.schedule, mask=mask)), layout, mask


def _visible(mask, q_pos: torch.Tensor, seq_len: int, causal: bool) -> torch.Tensor:
    from burstattn.masks import AttnMask

    return (mask or AttnMask()).dense(q_pos, torch.arange(seq_len), seq_len, causal)  # [R, N]


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.detach().double() - ref).abs().max() / ref.abs().max())


def _check_small(p: MaskPoint, rank: int, world: int) -> dict:
    """Relative errors of out, dq, dk, dv on this rank's rows at ``check_seq_len`` vs float64."""
    from burstattn.testing.oracle import exact_attention

    n_chk = p.check_seq_len
    fn, layout, mask = _call(p, n_chk, world)
    q, k, v, do = _global(p, n_chk, 1234, torch.float64)
    ref = [x.clone().requires_grad_() for x in (q, k, v)]
    out_ref = exact_attention(*ref, mask=_visible(mask, torch.arange(n_chk), n_chk, p.causal))[0]
    out_ref.backward(do)
    pos, dt = local_positions(n_chk, rank, world, layout), torch_dtype(p.dtype)
    loc = [x[:, pos].to(dt).requires_grad_() for x in (q, k, v)]
    out = fn(*loc)
    out.backward(do[:, pos].to(dt))
    got, want = (out, *(x.grad for x in loc)), (out_ref, *(x.grad for x in ref))
    return {key: _rel(g, w[:, pos]) for key, g, w in zip(("out", "dq", "dk", "dv"), got, want)}


def _check_rows(p: MaskPoint, mask, glob, pos, out, dq) -> dict:
    """Out and dQ of sampled rows of the full-size call against float64 with the mask."""
    from burstattn.testing.oracle import exact_rows

    n = pos.numel()
    idx = torch.linspace(0, n - 1, p.check_rows).round().long().unique()
    q, k, v, do = glob
    q_rows = q[:, pos[idx]].clone().requires_grad_()
    visible = _visible(mask, pos[idx], p.seq_len, p.causal)
    out_ref = exact_rows(q_rows, k, v, pos[idx], mask=visible)[0]
    out_ref.backward(do[:, pos[idx]].double())
    return {"out": _rel(out[:, idx], out_ref), "dq": _rel(dq[:, idx], q_rows.grad), "rows": len(idx)}


def _formula(p: MaskPoint, world: int, rank: int, layout, mask) -> dict:
    """The byte formula of this rank for the point: ``{"backward": used, "ops": {"phase/op": int}}``."""
    from burstattn.engine import bytes as formulas
    from burstattn.masks import AttnMask, choose_mask_backward, mask_bytes, mask_plan

    shape = dict(batch=p.batch, local_seq=p.seq_len // world, q_heads=p.heads, kv_heads=p.kv_heads,
                 head_dim=p.head_dim, dtype=torch_dtype(p.dtype))
    if p.schedule == "distflash":
        used, f = "distflash", formulas.distflash_bytes(rank=rank, world_size=world, **shape)
    elif mask is not None or not isinstance(layout, str):
        used = choose_mask_backward(**shape)
        plan = mask_plan(mask or AttnMask(), p.causal, p.seq_len, world, layout, rank)
        f = mask_bytes(plan, backward=used, **shape)
    else:
        used = formulas.choose_backward(world_size=world, **shape)
        f = formulas.ring_bytes(world_size=world, backward=used, **shape)
    return {"backward": used, "ops": {f"{ph}/{op}": b for (ph, op), b in f["ops"].items()}}


def _sent(stats) -> dict[str, int]:
    return stats.sent_by_op("str")


def _mask_point(rank: int, world: int, p: MaskPoint, progress_path: Optional[str]) -> dict:
    """One point on one rank (runs inside the pool); see the module docstring for the steps."""
    from burstattn import comm_stats

    ProgressFile(progress_path, rank).start(f"P={world} {p.suite}: {p.name}")
    try:
        fn, layout, mask = _call(p, p.seq_len, world)
    except ImportError as e:  # burstattn.layouts.partition not there yet
        return {"unavailable": f"{type(e).__name__}: {e}"}
    rec: dict = {"check": _check_small(p, rank, world)}
    glob = _global(p, p.seq_len, 7, torch.float32)  # float32: 4 ranks hold it at N = 32K
    pos, dt = local_positions(p.seq_len, rank, world, layout), torch_dtype(p.dtype)
    q, k, v = (x[:, pos].to(dt).requires_grad_() for x in glob[:3])
    grad = glob[3][:, pos].to(dt)

    def fwd():
        return fn(q, k, v)

    def fwd_bwd():
        q.grad = k.grad = v.grad = None
        out = fn(q, k, v)
        out.backward(grad)
        return out

    dist.barrier()
    with comm_stats() as s_fwd:
        fwd()
    dist.barrier()
    with comm_stats() as s_all:
        out = fwd_bwd()
    rec["sent"] = {"fwd": _sent(s_fwd), "fwd+bwd": _sent(s_all)}
    rec["formula"] = _formula(p, world, rank, layout, mask)
    rec["rows"] = _check_rows(p, mask, glob, pos, out.detach(), q.grad)
    del glob, out
    t = time_interleaved({"fwd": fwd, "fwd+bwd": fwd_bwd}, repeats=p.repeats, warmup=p.warmup, barrier=dist.barrier)
    rec["samples"] = {name: list(x.samples) for name, x in t.items()}
    return rec


# ---------------------------------------------------------------------------- parent side
def mask_grid(cfg: MasksConfig) -> dict[int, list[MaskPoint]]:
    """The plan: world size -> points (both suites share the spawn of a world size)."""
    common = dict(heads=cfg.heads, kv_heads=cfg.kv_heads, head_dim=cfg.head_dim, batch=cfg.batch, dtype=cfg.dtype,
                  repeats=cfg.repeats, warmup=cfg.warmup, check_seq_len=cfg.check_seq_len,
                  check_rows=cfg.check_rows)
    plan: dict[int, list[MaskPoint]] = {}
    if "masks" in cfg.suites:
        n, docs = cfg.seq_len, dict(documents=cfg.documents, doc_seed=cfg.doc_seed)
        plan.setdefault(cfg.world_size, []).extend([
            MaskPoint("masks", "dense causal", n, True, "zigzag", **common),
            MaskPoint("masks", "dense causal", n, True, "contiguous", **common),
            MaskPoint("masks", f"causal window N/{cfg.window_div}", n, True, "contiguous",
                      window_div=cfg.window_div, target=1 / 3, **common),
            *(MaskPoint("masks", f"{cfg.documents} packed documents", n, True, lay, **docs, **common)
              for lay in ("contiguous", "zigzag", "documents"))])
    if "distflash" in cfg.suites:
        n = cfg.distflash_seq_len
        for world in cfg.distflash_world_sizes:
            plan.setdefault(world, []).extend([
                *(MaskPoint("distflash", f"causal ring {lay}", n, True, lay, **common)
                  for lay in ("contiguous", "zigzag", "striped")),
                MaskPoint("distflash", "causal distflash", n, True, "contiguous", "distflash", target=0.6, **common),
                MaskPoint("distflash", "non-causal ring", n, False, "zigzag", **common)])
    return plan


def run_masks(cfg: MasksConfig, console=None) -> dict:
    """Run the suites; write ``masks.json`` and ``masks.md`` under ``cfg.out`` (and the section of
    ``cfg.docs``); return the JSON document."""
    from rich.console import Console

    from bench.driver import Pools, Started, document, publish, run_points
    from bench.masks_report import combine, derive, masks_markdown, update_section

    console = console or Console()
    eff = cfg.effective()
    points = [(world, p) for world, ps in sorted(mask_grid(eff).items()) for p in ps]
    started = Started.now()
    console.print(f"bench masks: {len(points)} points over world sizes {sorted({w for w, _ in points})}, "
                  f"1 thread per rank, {os.cpu_count()} cores")
    with Pools(timeout_s=7200.0, pg_timeout_s=1800.0) as pools:
        records = run_points("bench masks", points, _mask_point, combine, failed, pools=pools, console=console)
    derive(records)
    doc = document("masks", eff, started, records=records,
                   threads="torch.set_num_threads(1) in every rank (LocalPool threads_per_rank=1)")
    publish(eff.out, "masks", doc, masks_markdown(doc), eff.docs, update_section, console)
    return doc


def failed(p: MaskPoint, world: int, text: str) -> dict:
    """The record of a point whose ranks raised."""
    return {"suite": p.suite, "name": p.name, "layout": p.layout, "world_size": world, "config": asdict(p),
            "failed": text}

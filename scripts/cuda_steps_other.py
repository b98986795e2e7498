"""The other steps of the GPU session (:mod:`cuda_session`): the hybrids' recurrences, the dry run against
the allocator, and the device's rates for the simulator."""
from __future__ import annotations

import dataclasses
import importlib.util
import os

import torch
import torch.nn.functional as F

from burstattn.recurrent import (chunk_delta_rule, chunk_linear_attention, recurrent_reference, sp_gated_delta_rule,
                                 sp_ssd)
from cuda_session import Ctx, attention_flops, randn, rel, timed


def _gdn_inputs(ctx: Ctx, n: int, hk: int, hv: int, d: int, dtype):
    q, k = (F.normalize(randn(ctx, 1, n, hk, d, dtype=torch.float32, seed=s), dim=-1).to(dtype) for s in (0, 1))
    v = randn(ctx, 1, n, hv, d, dtype=dtype, seed=2)
    g = -F.softplus(randn(ctx, 1, n, hv, seed=3)).to(dtype) * 0.1  # log decay <= 0
    beta = torch.sigmoid(randn(ctx, 1, n, hv, seed=4)).to(dtype)
    return q, k, v, g, beta


def _ssd_inputs(ctx: Ctx, n: int, h: int, p: int, state: int, dtype):
    x = randn(ctx, 1, n, h, p, dtype=dtype, seed=0)
    dt = F.softplus(randn(ctx, 1, n, h, seed=1)).clamp(1e-3, 0.1).to(dtype)
    a = -torch.exp(randn(ctx, h, seed=2) * 0.5)
    b, c = (randn(ctx, 1, n, 1, state, dtype=dtype, seed=s) * state ** -0.5 for s in (3, 4))
    return x, dt, a, b, c


def _shards(world: int, fn, *xs):
    """The emulated P-rank state passing (contiguous shards, each starting from the state the previous one
    ends with): ``fn(*shard, initial_state) -> (o, S)``; returns the outputs joined and each shard's call."""
    n = xs[0].shape[1] // world
    state, outs = None, []
    for r in range(world):
        o, state = fn(*(x[:, r * n:(r + 1) * n] for x in xs), state)
        outs.append(o)
    return torch.cat(outs, 1)


def _gdn(ctx, n, world):
    hk, hv, d = ctx.size((4, 8, 128), (2, 4, 16))
    q, k, v, g, beta = _gdn_inputs(ctx, n, hk, hv, d, ctx.low)
    rep = hv // hk
    qr, kr = (x.repeat_interleave(rep, 2) for x in (q, k))
    one, _ = sp_gated_delta_rule(q, k, v, g, beta)
    emu = _shards(world, lambda q_, k_, v_, g_, b_, s: chunk_delta_rule(q_, k_, v_, g_, b_, initial_state=s),
                  qr, kr, v, g, beta)
    arms = {"sp_world1": lambda: sp_gated_delta_rule(q, k, v, g, beta),
            "sp_world1_torch_form": lambda: sp_gated_delta_rule(q, k, v, g, beta, kernel="torch"),
            "emulated_ranks": lambda: _shards(world, lambda q_, k_, v_, g_, b_, s: chunk_delta_rule(
                q_, k_, v_, g_, b_, initial_state=s), qr, kr, v, g, beta)}
    baseline = "torch chunked (chunk_delta_rule, whole sequence)"
    extra = {}
    if importlib.util.find_spec("fla") is not None and not ctx.dry:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        # the sharded op's per-segment kernel: fla's (kernel="fla", what "auto" picks here) against the torch form
        arms["sp_world1_fla_kernel"] = lambda: sp_gated_delta_rule(q, k, v, g, beta, kernel="fla")
        arms["fla"] = lambda: chunk_gated_delta_rule(qr, kr, v, g, beta)
        baseline = "flash-linear-attention chunk_gated_delta_rule"
        extra["fla_kernel_vs_torch_form_rel"] = rel(sp_gated_delta_rule(q, k, v, g, beta, kernel="fla")[0],
                                                    sp_gated_delta_rule(q, k, v, g, beta, kernel="torch")[0])
    else:
        arms["torch_chunked"] = lambda: chunk_delta_rule(qr, kr, v, g, beta)
        extra["fla_kernel"] = "skipped: flash-linear-attention not importable" if not ctx.dry else "skipped: dry"
    t = timed(ctx, arms, repeats=3, warmup=1)
    return dict(forward_ms={a: s * 1e3 for a, s in t.items()}, baseline=baseline,
                emulated_vs_world1_rel=rel(emu, one), heads=f"{hk}/{hv}", d=d, **extra)


def _gdn_exact(ctx):
    n = ctx.size(256, 32)
    q, k, v, g, beta = _gdn_inputs(ctx, n, 2, 4, 32, torch.float32)
    one, _ = sp_gated_delta_rule(q, k, v, g, beta)
    cpu = [x.double().cpu().repeat_interleave(2, 2) if x is q or x is k else x.double().cpu() for x in (q, k, v, g, beta)]
    ref, _ = recurrent_reference(*cpu)
    return dict(rel_vs_float64=rel(one.cpu(), ref), ok=rel(one.cpu(), ref) < 1e-5)


def _ssd(ctx, n, world):
    h, p, state = ctx.size((8, 64, 128), (2, 16, 16))
    x, dt, a, b, c = _ssd_inputs(ctx, n, h, p, state, ctx.low)
    one, _ = sp_ssd(x, dt, a, b, c)
    k = b.expand(-1, -1, h, -1) * dt.unsqueeze(-1)
    cq, g = c.expand(-1, -1, h, -1), dt * a.to(dt.dtype)
    emu = _shards(world, lambda q_, k_, v_, g_, s: chunk_linear_attention(q_, k_, v_, g_, initial_state=s), cq, k, x, g)
    arms = {"sp_world1": lambda: sp_ssd(x, dt, a, b, c),
            "emulated_ranks": lambda: _shards(world, lambda q_, k_, v_, g_, s: chunk_linear_attention(
                q_, k_, v_, g_, initial_state=s), cq, k, x, g),
            "torch_chunked": lambda: chunk_linear_attention(cq, k, x, g)}
    t = timed(ctx, arms, repeats=3, warmup=1)
    return dict(forward_ms={a_: s * 1e3 for a_, s in t.items()}, emulated_vs_world1_rel=rel(emu, one),
                baseline="torch chunked (chunk_linear_attention, whole sequence)")


def _ssd_exact(ctx):
    n = ctx.size(256, 32)
    x, dt, a, b, c = _ssd_inputs(ctx, n, 2, 16, 16, torch.float32)
    one, _ = sp_ssd(x, dt, a, b, c)
    h = x.shape[2]
    k = (b.expand(-1, -1, h, -1) * dt.unsqueeze(-1)).double().cpu()
    ref, _ = recurrent_reference(c.expand(-1, -1, h, -1).double().cpu(), k, x.double().cpu(), (dt * a).double().cpu())
    return dict(rel_vs_float64=rel(one.cpu(), ref), ok=rel(one.cpu(), ref) < 1e-5)


def step_hybrids(ctx: Ctx) -> None:
    """A Gated DeltaNet and an SSD layer at 32K, bf16 forward: the sharded path at world 1, the emulated
    P = 4 (each shard from the state the previous one ends with), against flash-linear-attention's kernel
    when importable, else the torch chunked form; exactness against float64 at 256 tokens."""
    n, world = ctx.size(32768, 128), ctx.size(4, 2)
    ctx.case("gated deltanet exact", lambda: _gdn_exact(ctx))
    ctx.case("ssd exact", lambda: _ssd_exact(ctx))
    ctx.case("gated deltanet 32K", lambda: _gdn(ctx, n, world), n=n, world=world)
    ctx.case("ssd 32K", lambda: _ssd(ctx, n, world), n=n, world=world)


def _dry_and_real(ctx, cfg):
    from burstattn.train.dryrun import dry_run

    rep = dry_run(cfg, 1, 0)
    row = dict(dry_peak_bytes=rep["peak_bytes"], dry_step_peak_bytes=rep["step_peak_bytes"],
               dry_workspace_bytes=rep["workspace_bytes"], attention_calls=rep.get("attention_calls"))
    if ctx.dry:
        return row
    import torch.distributed as dist

    from bench.train_memory import probe_step

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    real = probe_step(0, 1, cfg)
    alloc = torch.cuda.max_memory_allocated()
    return row | dict(real_step_peak_bytes=real["peak_bytes"], max_allocated_bytes=alloc,
                      max_reserved_bytes=torch.cuda.max_memory_reserved(),
                      step_error=rep["step_peak_bytes"] / real["peak_bytes"] - 1,
                      total_error=rep["peak_bytes"] / alloc - 1, target="within 10%")


def step_dryrun(ctx: Ctx) -> None:
    """``burstattn train --dry-run``'s peak against one real step (``torch.cuda.max_memory_allocated``):
    small-l3 at 32K with and without checkpointing and chunks, then a larger preset that fits the device."""
    from burstattn.train import TrainConfig

    seq = ctx.size(32768, 256)
    base = TrainConfig(model="small-l3", seq_len=seq, batch=1, steps=10, lr=1e-4, warmup=0, dtype="bfloat16")
    cases = [dict(checkpointing="none", mlp_chunk=0, loss_chunk=0),
             dict(checkpointing="remat", mlp_chunk=ctx.size(4096, 128), loss_chunk=ctx.size(1024, 128)),
             dict(checkpointing="full", mlp_chunk=ctx.size(4096, 128), loss_chunk=ctx.size(1024, 128))]
    if ctx.dry:  # builds and runs both kinds (with and without checkpointing and chunks) once
        cases = cases[:2]
    else:
        cases.append(dict(model="llama3-8b", seq_len=4096, checkpointing="remat", mlp_chunk=4096, loss_chunk=1024))
    for over in cases:
        cfg = base.with_overrides(**over)
        ctx.case("dry run vs allocator", lambda: _dry_and_real(ctx, cfg), config=dataclasses.asdict(cfg))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _rates(ctx):
    n, h, d = ctx.size(8192, 128), ctx.size(16, 2), ctx.size(128, 16)
    q, k, v = (randn(ctx, 1, h, n, d, dtype=ctx.low, seed=s, grad=True) for s in range(3))
    do = randn(ctx, 1, h, n, d, dtype=ctx.low, seed=3)
    holder = {}

    def fwd():
        holder["o"] = F.scaled_dot_product_attention(q, k, v)

    def fwd_bwd():
        torch.autograd.grad(F.scaled_dot_product_attention(q, k, v), (q, k, v), do)
    m = ctx.size(8192, 256)
    a, b = (randn(ctx, m, m, dtype=ctx.low, seed=s) for s in (5, 6))
    x = torch.empty(ctx.size(1 << 28, 1 << 16), dtype=torch.float32, device=ctx.dev)
    y = torch.empty_like(x)
    t = timed(ctx, {"fwd": fwd, "fwd_bwd": fwd_bwd, "mm": lambda: a @ b, "copy": lambda: y.copy_(x)})
    f = attention_flops(n, h, d, False) / 3.5  # the forward's FLOPs
    bwd = max(t["fwd_bwd"] - t["fwd"], 1e-9)
    return dict(attn_fwd_tflops=f / t["fwd"] / 1e12, attn_bwd_tflops=2.5 * f / bwd / 1e12,
                matmul_tflops=2 * m ** 3 / t["mm"] / 1e12, mem_bw_gbs=2 * x.numel() * 4 / t["copy"] / 1e9,
                shape=dict(n=n, heads=h, d=d, dtype="bfloat16", kernel="SDPA's best (non-causal)"))


def _presets():
    from burstattn.sim.hardware import preset

    out = {}
    for name in ("h100-nvlink-ib", "h200-nvlink-ib"):
        hw = preset(name)
        out[name] = dict(attn_fwd_tflops=hw.peak_flops * hw.attn_fwd_eff / 1e12,
                         attn_bwd_tflops=hw.peak_flops * hw.attn_bwd_eff / 1e12,
                         matmul_tflops=hw.peak_flops * hw.matmul_eff / 1e12, mem_bw_gbs=hw.mem_bw / 1e9)
    return out


def step_calibrate(ctx: Ctx) -> None:
    """The device's attention forward / backward, matmul and memory rates (what ``burstattn sim``'s GPU
    presets state), beside the H100 / H200 presets. (``burstattn sim calibrate`` itself measures the CPU
    kernels and the gloo link; the session runs it as a step of its own.)"""
    ctx.case("device rates", lambda: _rates(ctx) | dict(presets=_presets()))

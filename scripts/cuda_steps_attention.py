"""The attention steps of the GPU session (:mod:`cuda_session`): exactness, world-1 time against SDPA, one
rank's efficiency in a world-P plan, and masks against dense causal."""
from __future__ import annotations

import torch
import torch.nn.functional as F

import burstattn
from burstattn.engine.run import gathered_backward
from burstattn.call.emulated import emulate, emulated_backward, emulated_forward, kv_blocks, rank_forward
from burstattn.testing.oracle import exact_attention
from cuda_session import Ctx, attention_flops, max_abs, randn, rel, timed

RULE = {"out": 2.0, "dq": 3.0, "dk": 3.0, "dv": 3.0}  # flash-attn's factors over plain PyTorch's own 16-bit error


def _inputs(ctx: Ctx, n: int, hq: int, hkv: int, d: int, dtype, seed: int = 0, grad: bool = False):
    return (randn(ctx, 1, n, hq, d, dtype=dtype, seed=seed, grad=grad),
            randn(ctx, 1, n, hkv, d, dtype=dtype, seed=seed + 1, grad=grad),
            randn(ctx, 1, n, hkv, d, dtype=dtype, seed=seed + 2, grad=grad),
            randn(ctx, 1, n, hq, d, dtype=dtype, seed=seed + 3))


def _plain(q, k, v, dout, vis, dtype):
    """Plain attention in ``dtype`` (flash-attn's ``attention_ref``): out and grads, ``vis [N, N]`` bool."""
    leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
    g = q.shape[2] // k.shape[2]
    kk, vv = (x.repeat_interleave(g, 2) for x in leaves[1:])
    s = torch.einsum("bthd,bshd->bhts", leaves[0], kk * q.shape[-1] ** -0.5).masked_fill(~vis, float("-inf"))
    out = torch.einsum("bhts,bshd->bthd", torch.softmax(s, -1).nan_to_num(0.0).to(dtype), vv)
    grads = torch.autograd.grad(out, leaves, dout.to(dtype))
    return dict(out=out.detach(), dq=grads[0], dk=grads[1], dv=grads[2])


def _errors(got: dict, q, k, v, dout, vis, dtype) -> dict:
    """float32/float64: relative errors against float64; 16-bit: flash-attn's rule (max abs error against
    float32 within RULE x plain PyTorch's own 16-bit error)."""
    if dtype in (torch.float32, torch.float64):
        leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
        ref, _ = exact_attention(*leaves, mask=vis)
        grads = torch.autograd.grad(ref, leaves, dout.double())
        errs = {n: rel(got[n], r) for n, r in zip(("out", "dq", "dk", "dv"), (ref, *grads))}
        return dict(errors=errs, ok=all(e <= 1e-5 for e in errs.values()), bound="1e-5 relative")
    truth = _plain(q, k, v, dout, vis, torch.float32)
    plain = _plain(q, k, v, dout, vis, dtype)
    errs = {n: max_abs(got[n], truth[n]) for n in RULE}
    bounds = {n: RULE[n] * max_abs(plain[n], truth[n]) for n in RULE}
    return dict(errors=errs, bounds=bounds, ok=all(errs[n] <= bounds[n] for n in RULE))


def _visible(mask, n: int, causal: bool, device) -> torch.Tensor:
    pos = torch.arange(n)
    if mask is None:
        vis = torch.ones(n, n, dtype=torch.bool).tril() if causal else torch.ones(n, n, dtype=torch.bool)
    else:
        vis = mask.dense(pos, pos, n, causal)
    return vis.to(device)


def _masks(n: int) -> dict:
    docs = [0] + [n * (i + 1) // 8 for i in range(8)]
    local, first = max(n // 16, 1), max(n // 128, 1)
    return {"none": None, "window N/8": burstattn.AttnMask(window=(n // 8, 0)),
            "8 documents": burstattn.AttnMask(cu_seqlens=docs),
            "mask_mod local+global": burstattn.AttnMask(mask_mod=lambda q, k: (q - k < local) | (k < first),
                                                        block_size=min(256, max(n // 8, 16)))}


def _emulated_case(ctx, mask, world, n, dtype, causal=True, hq=8, hkv=2, d=64):
    q, k, v, dout = _inputs(ctx, n, hq, hkv, d, dtype)
    em = emulate(q, v, world, causal=causal, layout="zigzag", mask=mask, device_type=ctx.device_type)
    out, lse = emulated_forward(em, q, k, v)
    dq, dk, dv = emulated_backward(em, dout, q, k, v, out, lse)
    res = _errors(dict(out=out, dq=dq, dk=dk, dv=dv), q, k, v, dout, _visible(mask, n, causal, ctx.dev), dtype)
    return dict(policy=str(em.calls[0].pair_kernel.__class__.__name__ if em.calls[0].pair_kernel else "blocks"),
                fp32_grads=em.calls[0].fp32_grads, **res)


def _world1_case(ctx, mask_args, n, dtype, causal, hq, hkv, d, vis_mask=None):
    q, k, v, dout = _inputs(ctx, n, hq, hkv, d, dtype, grad=True)
    out = burstattn.burst_attn_func(q, k, v, causal=causal, device_type=ctx.device_type, **mask_args)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    return _errors(dict(out=out, dq=dq, dk=dk, dv=dv), q, k, v, dout, _visible(vis_mask, n, causal, ctx.dev), dtype)


def step_exact(ctx: Ctx) -> None:
    """World 1 (dense) and the emulated ring, P = 2, 4, 8, zigzag causal: float32 against float64 (1e-5
    relative), bf16 within flash-attn's rule, default ``grad_partials``."""
    n = ctx.size(2048, 64)
    d = ctx.size(64, 16)
    for dtype in (torch.float32, torch.bfloat16):
        for causal in (False, True):
            for hq, hkv in ((8, 2), (8, 8)):
                ctx.case("world1 dense", lambda: _world1_case(ctx, {}, n, dtype, causal, hq, hkv, d),
                         dtype=str(dtype), causal=causal, heads=f"{hq}/{hkv}", n=n)
    masks = _masks(n)
    for world in ctx.size((2, 4, 8), (2,)):
        for name in ("none", "8 documents", "window N/8") + (("mask_mod local+global",) if world == 4 or ctx.dry else ()):
            for dtype in (torch.float32, torch.bfloat16):
                ctx.case(f"emulated ring {name}", lambda: _emulated_case(ctx, masks[name], world, n, dtype, d=d),
                         world=world, dtype=str(dtype), n=n)


def _sdpa(q, k, v, causal):
    """SDPA's best kernel on ``[B, H, N, D]`` (GQA through ``enable_gqa``)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])


def _world1_time(ctx, n, hq, hkv, d, causal):
    q, k, v, dout = _inputs(ctx, n, hq, hkv, d, ctx.low, grad=True)
    qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
    dt = dout.transpose(1, 2).contiguous()

    def ours():
        torch.autograd.grad(burstattn.burst_attn_func(q, k, v, causal=causal, device_type=ctx.device_type),
                            (q, k, v), dout)

    def sdpa():
        torch.autograd.grad(_sdpa(qt, kt, vt, causal), (qt, kt, vt), dt)
    t = timed(ctx, {"burst": ours, "sdpa": sdpa})
    flops = attention_flops(n, hq, d, causal)
    return dict(burst_ms=t["burst"] * 1e3, sdpa_ms=t["sdpa"] * 1e3, ratio=t["burst"] / t["sdpa"],
                burst_tflops=flops / t["burst"] / 1e12, sdpa_tflops=flops / t["sdpa"] / 1e12, target="ratio <= 1.05")


def step_world1(ctx: Ctx) -> None:
    """``burst_attn_func`` at world 1 against SDPA's best kernel, bf16 fwd+bwd, N = 16K and 32K."""
    d = ctx.size(128, 16)
    for n in ctx.size((16384, 32768), (128,)):
        for causal in (False, True):
            for hq, hkv in ctx.size(((16, 16), (32, 8)), ((4, 4), (4, 2))):
                ctx.case("world1 vs sdpa", lambda: _world1_time(ctx, n, hq, hkv, d, causal), n=n, causal=causal,
                         heads=f"{hq}/{hkv}", d=d)


def _rank_time(ctx, em, rank, q, k, v, dout, blocks):
    """One rank's forward + backward kernel calls and merges of the emulated plan."""
    out, lse = rank_forward(em, rank, q, blocks)
    gathered_backward(em.plans[rank], em.calls[rank], em.shard(dout, rank), em.shard(q, rank), blocks, out, lse)


def _per_rank(ctx, world, n, hq, hkv, d, causal):
    q, k, v, dout = _inputs(ctx, n, hq, hkv, d, ctx.low)
    em = emulate(q, v, world, causal=causal, layout="zigzag", device_type=ctx.device_type)
    blocks = kv_blocks(em, k, v)
    qt, kt, vt = (x.transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
    dt = dout.transpose(1, 2).contiguous()
    arms = {f"rank{r}": (lambda r=r: _rank_time(ctx, em, r, q, k, v, dout, blocks)) for r in (0, world - 1)}
    arms["sdpa_full"] = lambda: torch.autograd.grad(_sdpa(qt, kt, vt, causal), (qt, kt, vt), dt)
    t = timed(ctx, arms)
    rank = max(t[f"rank{r}"] for r in (0, world - 1))
    ideal = t["sdpa_full"] / world
    pairs = [sum(1 for st in em.plans[r].steps for p in st.pairs if p.ops) for r in (0, world - 1)]
    return dict(rank_ms=rank * 1e3, sdpa_full_ms=t["sdpa_full"] * 1e3, efficiency=ideal / rank, pairs=pairs,
                target="efficiency >= 0.90 at P = 8")


def step_per_rank(ctx: Ctx) -> None:
    """One rank's kernel calls of a world-P plan (zigzag; P = 2, 4, 8) on the device, against the ideal
    share of one SDPA call over the whole sequence (its time / P)."""
    n, d = ctx.size(32768, 64), ctx.size(128, 16)
    hq, hkv = ctx.size((32, 8), (4, 2))
    for causal in (True, False):
        for world in ctx.size((2, 4, 8), (2,)):
            ctx.case("per-rank efficiency", lambda: _per_rank(ctx, world, n, hq, hkv, d, causal), world=world,
                     causal=causal, n=n, heads=f"{hq}/{hkv}", d=d)


def _mask_args(mask) -> dict:
    return {} if mask is None else {"mask": mask}


def _masked_world1(ctx, masks, n, hq, hkv, d):
    q, k, v, dout = _inputs(ctx, n, hq, hkv, d, ctx.low, grad=True)
    def call(m):
        out = burstattn.burst_attn_func(q, k, v, causal=True, device_type=ctx.device_type, **_mask_args(m))
        torch.autograd.grad(out, (q, k, v), dout)
    arms = {name: (lambda m=m: call(m)) for name, m in masks.items()}
    t = timed(ctx, arms, repeats=3, warmup=1)
    return {f"{name}_ms": s * 1e3 for name, s in t.items()} | {
        f"{name}_speedup": t["none"] / s for name, s in t.items() if name != "none"}


def _masked_rank(ctx, masks, world, n, hq, hkv, d):
    q, k, v, dout = _inputs(ctx, n, hq, hkv, d, ctx.low)
    arms = {}
    for name, m in masks.items():
        em = emulate(q, v, world, causal=True, layout="zigzag", mask=m, device_type=ctx.device_type)
        blocks = kv_blocks(em, k, v)
        arms[name] = lambda em=em, blocks=blocks: [_rank_time(ctx, em, r, q, k, v, dout, blocks) for r in range(world)]
    t = timed(ctx, arms, repeats=3, warmup=1)
    return {f"{name}_ms_all_ranks": s * 1e3 for name, s in t.items()} | {
        f"{name}_speedup": t["none"] / s for name, s in t.items() if name != "none"}


def step_masks(ctx: Ctx) -> None:
    """Masks against dense causal at 32K (bf16, 16/4 heads, d 128): world 1 and every rank of the emulated
    P = 4 (targets: window and documents >= 3x, the mask_mod >= 2x); their exactness at 2K, world 1 and P = 4."""
    n, d = ctx.size(32768, 128), ctx.size(128, 16)
    hq, hkv = ctx.size((16, 4), (4, 2))
    masks = _masks(n)
    ctx.case("masks world1 vs dense causal", lambda: _masked_world1(ctx, masks, n, hq, hkv, d), n=n,
             heads=f"{hq}/{hkv}", targets="window, documents >= 3x; mask_mod >= 2x")
    small = ctx.size(2048, 64)
    smasks = _masks(small)
    for name in ("window N/8", "8 documents", "mask_mod local+global"):
        for dtype in (torch.bfloat16, torch.float32):
            ctx.case(f"exact world1 {name}", lambda: _world1_case(ctx, {"mask": smasks[name]}, small, dtype, True, 8, 2,
                                                                  ctx.size(64, 16), smasks[name]),
                     n=small, dtype=str(dtype))
            ctx.case(f"exact emulated P=4 {name}",
                     lambda: _emulated_case(ctx, smasks[name], ctx.size(4, 2), small, dtype, d=ctx.size(64, 16)),
                     n=small, dtype=str(dtype))
    ctx.case("masks emulated P=4 vs dense causal", lambda: _masked_rank(ctx, masks, ctx.size(4, 2), n, hq, hkv, d),
             n=n, heads=f"{hq}/{hkv}")


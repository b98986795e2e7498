"""One-shot CUDA check of burstattn (run on a GPU machine): correctness of the CUDA kernels and of
the ring on CUDA tensors, and kernel timing. Writes a JSON report.

    python scripts/cuda_check.py --out cuda_report.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import burstattn  # noqa: E402
from burstattn.kernels import available_backends, get_kernel  # noqa: E402
from burstattn.kernels.plain import PlainKernel  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def dense(q, k, v, causal):
    """float64 dense attention, [B, N, H, D] layout."""
    q, k, v = (x.double() for x in (q, k, v))
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    s = torch.einsum("bihd,bjhd->bhij", q, k) * q.shape[-1] ** -0.5
    if causal:
        n = q.shape[1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), -math.inf)
    return torch.einsum("bhij,bjhd->bihd", s.softmax(-1), v)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def check_case(N, hq, hkv, d, dtype, causal, backend, layout="zigzag", world=1, rank=0, group=None):
    g = torch.Generator(device="cuda").manual_seed(0)
    full = [torch.randn(1, N, h, d, device="cuda", generator=g) for h in (hq, hkv, hkv, hq)]
    qd, kd, vd = (x.double().requires_grad_() for x in full[:3])
    ref = dense(qd, kd, vd, causal)
    ref.backward(full[3].double())
    sh = (lambda x: burstattn.shard_sequence(x, layout=layout, group=group)) if world > 1 else (lambda x: x)
    q, k, v = (sh(x).to(dtype).requires_grad_() for x in full[:3])
    out = burstattn.burst_attn_func(q, k, v, causal=causal, backend=backend, layout=layout, group=group)
    out.backward(sh(full[3]).to(dtype))
    errs = {"out": rel(out, sh(ref)), "dq": rel(q.grad, sh(qd.grad)), "dk": rel(k.grad, sh(kd.grad)),
            "dv": rel(v.grad, sh(vd.grad))}
    return errs, all(e <= TOL[dtype] for e in errs.values())


def kernel_checks(report):
    """Each CUDA kernel vs the reference kernel on block shapes the engine uses (Sq != Sk too)."""
    ref = PlainKernel()
    rows = []
    for backend in [b for b in available_backends(torch.device("cuda")) if b != "reference"]:
        kern = get_kernel(backend)
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            if backend == "flash_attn" and dtype == torch.float32:
                continue
            for sq, sk, causal in ((256, 256, True), (256, 128, False), (128, 256, False)):
                for hq, hkv, d in ((8, 2, 64), (4, 4, 128)):
                    g = torch.Generator(device="cuda").manual_seed(1)
                    q = torch.randn(2, hq, sq, d, device="cuda", generator=g).to(dtype)
                    k, v = (torch.randn(2, hkv, sk, d, device="cuda", generator=g).to(dtype) for _ in range(2))
                    do = torch.randn(2, hq, sq, d, device="cuda", generator=g).to(dtype)
                    s = d ** -0.5
                    o, l = kern.forward(q, k, v, s, causal)
                    o_r, l_r = ref.forward(q.double(), k.double(), v.double(), s, causal)
                    gr = kern.backward(do, q, k, v, o, l, s, causal)
                    gr_r = ref.backward(do.double(), q.double(), k.double(), v.double(), o_r, l_r.double(), s, causal)
                    e = {"out": rel(o, o_r), "lse": rel(l, l_r), "dq": rel(gr[0], gr_r[0]),
                         "dk": rel(gr[1], gr_r[1]), "dv": rel(gr[2], gr_r[2])}
                    ok = all(x <= TOL[dtype] for x in e.values())
                    rows.append(dict(backend=backend, dtype=str(dtype), sq=sq, sk=sk, causal=causal,
                                     hq=hq, hkv=hkv, d=d, errs=e, ok=ok))
    report["kernels"] = rows


def api_checks(report):
    rows = []
    for backend in ("auto", "sdpa", "reference"):
        for dtype in (torch.bfloat16, torch.float32):
            for causal in (False, True):
                for hq, hkv, d in ((8, 2, 64), (8, 8, 128)):
                    errs, ok = check_case(512, hq, hkv, d, dtype, causal, backend)
                    rows.append(dict(backend=backend, dtype=str(dtype), causal=causal, hq=hq, hkv=hkv, d=d,
                                     errs=errs, ok=ok))
    report["api_world1"] = rows


def _ring_worker(rank, world, port, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rows = []
    try:
        for layout in ("zigzag", "striped", "contiguous"):
            for backward in ("burst", "kv"):
                for dtype in (torch.bfloat16, torch.float32):
                    import burstattn as ba
                    errs, ok = check_case(96 * world, 8, 2, 64, dtype, True, "sdpa", layout, world, rank)
                    rows.append(dict(world=world, layout=layout, dtype=str(dtype), errs=errs, ok=ok))
        q.put((rank, rows, None))
    except Exception:
        q.put((rank, rows, traceback.format_exc()))
    dist.destroy_process_group()


def ring_checks(report):
    """Ring over CUDA tensors with gloo (one GPU, several processes), if gloo moves CUDA tensors."""
    out = []
    ctx = mp.get_context("spawn")
    for world in (2, 3):
        q = ctx.Queue()
        procs = [ctx.Process(target=_ring_worker, args=(r, world, 29700 + world, q)) for r in range(world)]
        for p in procs:
            p.start()
        res = [q.get(timeout=300) for _ in procs]
        for p in procs:
            p.join(60)
        out.append({"world": world, "results": sorted(res, key=lambda r: r[0])})
    report["ring_gloo_cuda"] = out


def timing(report):
    rows = []
    for N, hq, hkv, d in ((16384, 16, 16, 128), (32768, 32, 8, 128)):
        for causal in (False, True):
            q = torch.randn(1, N, hq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            k, v = (torch.randn(1, N, hkv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
            do = torch.randn_like(q)

            def ours():
                burstattn.burst_attn_func(q, k, v, causal=causal, backend="sdpa").backward(do)

            def raw():
                ke, ve = (x.repeat_interleave(hq // hkv, 2) for x in (k, v))
                torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(1, 2), ke.transpose(1, 2), ve.transpose(1, 2), is_causal=causal).backward(do.transpose(1, 2))

            res = {}
            for name, f in (("burst_w1", ours), ("torch_sdpa", raw)):
                for _ in range(2):
                    f()
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                ts = []
                for _ in range(5):
                    t0 = time.perf_counter(); f(); torch.cuda.synchronize(); ts.append(time.perf_counter() - t0)
                ts.sort()
                flops = 4 * N * N * hq * d * 3.5 * (0.5 if causal else 1.0)
                res[name] = dict(median_s=ts[2], tflops=flops / ts[2] / 1e12,
                                 peak_gib=torch.cuda.max_memory_allocated() / 2**30)
            rows.append(dict(N=N, hq=hq, hkv=hkv, d=d, causal=causal, **res))
    report["timing_fwd_bwd_bf16"] = rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="cuda_report.json")
    args = ap.parse_args()
    report = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0),
              "backends": available_backends(torch.device("cuda"))}
    for step in (kernel_checks, api_checks, timing):
        t0 = time.time()
        try:
            step(report)
        except Exception:
            report[step.__name__ + "_error"] = traceback.format_exc()
        print(step.__name__, f"{time.time() - t0:.1f}s", flush=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    bad = [r for key in ("kernels", "api_world1") for r in report.get(key, []) if not r["ok"]]
    print("failures:", len(bad))
    for r in bad[:20]:
        print(r)


if __name__ == "__main__":
    main()

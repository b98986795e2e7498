"""One-shot CUDA check of masked attention (run on a GPU machine, world size 1): the partial-tile
path (SDPA's memory-efficient kernel with a bias) and the full/causal tiles against float64 with the
same mask, forward and gradients, then fwd+bwd time of a window and of packed documents against
dense causal. Writes a JSON report.

    python scripts/cuda_masks.py --out cuda_masks.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import burstattn  # noqa: E402
from burstattn.masks import AttnMask  # noqa: E402
from burstattn.testing.oracle import exact_attention  # noqa: E402

TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def local_global(q, k):
    return (q // 128 == k // 128) | (k < 32)


def blind(q, k):
    return (q % 7 != 0) & (k >= 0)


def masks(n: int) -> dict:
    return {"window_causal": dict(window=(n // 8, 0)), "window_sym": dict(window=(100, 50)),
            "docs": dict(cu_seqlens=[0, 1, n // 3, n // 3 + 77, n]), "local_global": dict(mask_mod=local_global),
            "blind_rows": dict(mask_mod=blind)}


def check(dtype, n=1024, heads=(8, 2), d=64) -> list[dict]:
    out = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, kw in masks(n).items():
        for causal in (False, True):
            try:
                q = torch.randn(1, n, heads[0], d, device="cuda", generator=gen, dtype=dtype).requires_grad_()
                k, v = (torch.randn(1, n, heads[1], d, device="cuda", generator=gen, dtype=dtype).requires_grad_()
                        for _ in "kv")
                g = torch.randn(1, n, heads[0], d, device="cuda", generator=gen, dtype=dtype)
                m = AttnMask(block_size=128, **kw)
                o, lse = burstattn.burst_attn_func(q, k, v, causal=causal, mask=m, backend="sdpa", return_lse=True)
                o.backward(g)
                pos = torch.arange(n, device="cuda")
                dense = m.dense(pos.cpu(), pos.cpu(), n, causal).cuda()
                r = [x.detach().double().requires_grad_() for x in (q, k, v)]
                ro, rl = exact_attention(*r, causal=causal, mask=dense)
                ro.backward(g.double())
                floor = float(r[2].grad.norm())
                errs = {nm: float((a.double() - b).norm() / max(float(b.norm()), floor))
                        for nm, a, b in (("out", o, ro), ("dq", q.grad, r[0].grad), ("dk", k.grad, r[1].grad),
                                         ("dv", v.grad, r[2].grad))}
                inf_ok = bool(torch.equal(torch.isinf(lse), torch.isinf(rl)))
                finite = all(bool(torch.isfinite(x).all()) for x in (o, q.grad, k.grad, v.grad))
                ok = finite and inf_ok and max(errs.values()) <= TOL[dtype]
                out.append(dict(mask=name, causal=causal, dtype=str(dtype), errors=errs, lse_inf_rows_match=inf_ok,
                                finite=finite, ok=ok))
            except Exception as e:  # report, keep going
                out.append(dict(mask=name, causal=causal, dtype=str(dtype), ok=False, error=repr(e),
                                tb=traceback.format_exc()[-1500:]))
            print(out[-1], flush=True)
    return out


def timing(n=32768, heads=(16, 4), d=128, repeats=5) -> dict:
    dt = torch.bfloat16
    q = torch.randn(1, n, heads[0], d, device="cuda", dtype=dt, requires_grad=True)
    k, v = (torch.randn(1, n, heads[1], d, device="cuda", dtype=dt, requires_grad=True) for _ in "kv")
    g = torch.randn(1, n, heads[0], d, device="cuda", dtype=dt)
    docs = [0] + sorted(torch.randperm(n - 1, generator=torch.Generator().manual_seed(0))[:7].add(1).tolist()) + [n]
    points = {"dense causal": {}, "window N/8": dict(mask=AttnMask(window=(n // 8, 0))),
              "8 documents": dict(mask=AttnMask(cu_seqlens=docs))}
    res = {}
    for name, kw in points.items():
        def run():
            q.grad = k.grad = v.grad = None
            burstattn.burst_attn_func(q, k, v, causal=True, backend="sdpa", **kw).backward(g)
        run()
        torch.cuda.synchronize()
        ts = []
        for _ in range(repeats):
            t = time.perf_counter()
            run()
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t)
        res[name] = sorted(ts)[len(ts) // 2] * 1e3
        print(name, f"{res[name]:.1f} ms", flush=True)
    res["docs"] = docs
    return res


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="cuda_masks.json")
    ns = p.parse_args()
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    report["checks"] = check(torch.float32) + check(torch.bfloat16)
    try:
        report["timing_ms"] = timing()
    except Exception as e:
        report["timing_error"] = repr(e)
    report["all_ok"] = all(c["ok"] for c in report["checks"])
    with open(ns.out, "w") as f:
        json.dump(report, f, indent=1)
    print("ALL OK" if report["all_ok"] else "FAILURES", flush=True)
    return 0 if report["all_ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

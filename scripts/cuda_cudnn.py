"""Check + time the cuDNN path of the sdpa backend against the flash path (bf16/fp16)."""
import json, os, sys, time
import torch
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import burstattn
from burstattn.kernels.sdpa import SdpaKernel
from burstattn.kernels.plain import PlainKernel
def rel(a, b): return ((a.double() - b.double()).norm() / b.double().norm()).item()
rows = []
ref = PlainKernel()
for prefer in (True, False):
    kern = SdpaKernel(prefer_cudnn=prefer)
    for dtype in (torch.bfloat16, torch.float16):
        for sq, sk, causal in ((256, 256, True), (256, 128, False), (128, 256, False), (255, 255, True)):
            for hq, hkv, d in ((8, 2, 64), (4, 4, 128)):
                try:
                    g = torch.Generator(device="cuda").manual_seed(1)
                    # BSHD memory viewed as BHSD, as the engine passes them
                    q = torch.randn(2, sq, hq, d, device="cuda", generator=g).to(dtype).transpose(1, 2)
                    k, v = (torch.randn(2, sk, hkv, d, device="cuda", generator=g).to(dtype).transpose(1, 2) for _ in range(2))
                    do = torch.randn(2, sq, hq, d, device="cuda", generator=g).to(dtype).transpose(1, 2)
                    s = d ** -0.5
                    o, l = kern.forward(q, k, v, s, causal)
                    o_r, l_r = ref.forward(q.double(), k.double(), v.double(), s, causal)
                    gr = kern.backward(do, q, k, v, o, l, s, causal)
                    gr_r = ref.backward(do.double(), q.double(), k.double(), v.double(), o_r, l_r.double(), s, causal)
                    e = {"out": rel(o, o_r), "lse": rel(l, l_r), "dq": rel(gr[0], gr_r[0]), "dk": rel(gr[1], gr_r[1]), "dv": rel(gr[2], gr_r[2])}
                    rows.append(dict(cudnn=prefer, dtype=str(dtype), sq=sq, sk=sk, causal=causal, hq=hq, d=d, ok=max(e.values()) < 2e-2, errs={a: f"{b:.1e}" for a, b in e.items()}))
                except Exception as ex:
                    rows.append(dict(cudnn=prefer, dtype=str(dtype), sq=sq, sk=sk, causal=causal, hq=hq, d=d, ok=False, error=repr(ex)[:300]))
for r in rows: print(r)
def bench(f, n=5):
    for _ in range(2): f()
    torch.cuda.synchronize(); ts = []
    for _ in range(n):
        t0 = time.perf_counter(); f(); torch.cuda.synchronize(); ts.append(time.perf_counter() - t0)
    return sorted(ts)[n // 2]
N, H, D = 16384, 16, 128
for causal in (False, True):
    q, k, v, do = (torch.randn(1, N, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    for x in (q, k, v): x.requires_grad_()
    t = {}
    t["burst_sdpa_fb"] = bench(lambda: burstattn.burst_attn_func(q, k, v, causal=causal, backend="sdpa").backward(do))
    t["burst_sdpa_fwd"] = bench(lambda: burstattn.burst_attn_func(q, k, v, causal=causal, backend="sdpa"))
    qt, kt, vt, dt = (x.detach().transpose(1, 2) for x in (q, k, v, do))
    for x in (qt, kt, vt): x.requires_grad_()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        t["torch_cudnn_fb"] = bench(lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).backward(dt))
    print("causal", causal, {a: round(b * 1e3, 2) for a, b in t.items()})

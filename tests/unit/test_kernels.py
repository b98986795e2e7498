"""Local kernels (internal layout [B, H, S, D]) against the float64 oracle, forward and
backward, per mask kind; the backward is given the global out/lse, as the ring gives it."""
from __future__ import annotations

import pytest
import torch

from burstattn.kernels import available_backends, get_kernel, resolve_backend
from burstattn.testing.oracle import exact_rows
from tests.helpers import EXACT, rel_err, rule_bounds

KERNELS = ["reference", "cpu_flash"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def make(b, hq, hkv, sq, sk, d, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, sq, d, generator=gen).to(dtype)
    k = torch.randn(b, hkv, sk, d, generator=gen).to(dtype)
    v = torch.randn(b, hkv, sk, d, generator=gen).to(dtype)
    dout = torch.randn(b, hq, sq, d, generator=gen).to(dtype)
    return q, k, v, dout


def oracle(q, k, v, dout, scale, causal):
    """float64 out [B,H,Sq,D], lse [B,H,Sq] and grads, via exact_rows (which is [B, S, H, D])."""
    q64, k64, v64 = (x.transpose(1, 2).double().requires_grad_() for x in (q, k, v))
    rows = torch.arange(q.shape[2]) if causal else torch.zeros(q.shape[2], dtype=torch.long)
    out, lse = exact_rows(q64, k64, v64, rows, causal=causal, softmax_scale=scale)
    out.backward(dout.transpose(1, 2).double())
    return out.detach().transpose(1, 2), lse.detach(), *(x.grad.transpose(1, 2) for x in (q64, k64, v64))


SHAPES = [  # (hq, hkv, sq, sk, causal)
    (4, 4, 24, 24, False), (4, 4, 24, 24, True), (8, 2, 16, 40, False), (8, 2, 40, 16, False),
    (8, 2, 32, 32, True), (4, 1, 17, 17, True), (4, 1, 9, 33, False),
]


@pytest.mark.parametrize("name", KERNELS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}-{}_s{}x{}_{}".format(*s[:4], "causal" if s[4] else "full"))
@pytest.mark.parametrize("d", [16, 64])
def test_kernel_forward_and_backward(name, dtype, shape, d):
    hq, hkv, sq, sk, causal = shape
    q, k, v, dout = make(2, hq, hkv, sq, sk, d, DTYPES[dtype], seed=sq + sk + d)
    scale = 0.7 * d ** -0.5
    kernel = get_kernel(name)
    out, lse = kernel.forward(q, k, v, scale, causal)
    out_ref, lse_ref, dq_ref, dk_ref, dv_ref = oracle(q, k, v, dout, scale, causal)
    assert out.shape == q.shape and lse.shape == q.shape[:3] and lse.dtype == torch.float32
    # the backward gets the (global) output in the input dtype and the float32 lse
    dq, dk, dv = kernel.backward(dout, q, k, v, out_ref.to(q.dtype), lse_ref.float(), scale, causal)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    got = dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)
    if dtype in EXACT:
        ref = dict(out=out_ref, lse=lse_ref, dq=dq_ref, dk=dk_ref, dv=dv_ref)
        errors = {name: rel_err(x, ref[name]) for name, x in got.items()}
        assert all(e <= EXACT[dtype] for e in errors.values()), errors
        return
    # 16-bit: flash-attn's rule (tests/helpers.py) on the [B, S, H, D] view of the same block
    truth, bounds = rule_bounds(*(x.transpose(1, 2) for x in (q, k, v, dout)), causal=causal, softmax_scale=scale)
    errors = {name: float((x.double() - (truth[name] if name == "lse" else truth[name].transpose(1, 2))).abs().max())
              for name, x in got.items()}
    assert all(errors[n] <= bounds[n] for n in errors), (errors, bounds)


@pytest.mark.parametrize("name", KERNELS)
def test_backward_with_global_lse_sums_over_key_blocks(name):
    """Gradients of two key blocks, each given the lse of ALL keys, add up to the full gradient."""
    q, k, v, dout = make(1, 4, 2, 12, 30, 16, torch.float32, seed=5)
    scale = 0.25
    out_ref, lse_ref, dq_ref, dk_ref, dv_ref = oracle(q, k, v, dout, scale, False)
    kernel = get_kernel(name)
    grads = [kernel.backward(dout, q, k[:, :, sl], v[:, :, sl], out_ref.float(), lse_ref.float(), scale, False)
             for sl in (slice(0, 11), slice(11, 30))]
    assert rel_err(grads[0][0] + grads[1][0], dq_ref) <= 1e-5
    assert rel_err(torch.cat([grads[0][1], grads[1][1]], 2), dk_ref) <= 1e-5
    assert rel_err(torch.cat([grads[0][2], grads[1][2]], 2), dv_ref) <= 1e-5


def test_backend_resolution_on_cpu():
    cpu = torch.device("cpu")
    assert available_backends(cpu)[-1] == "reference"
    assert resolve_backend("auto", cpu, torch.float32) in available_backends(cpu)
    assert resolve_backend("auto", cpu, torch.float64) == "reference"
    for name in ("sdpa", "flash_attn"):
        with pytest.raises(ValueError, match=rf"{name}.*available.*reference"):
            resolve_backend(name, cpu, torch.bfloat16)
    with pytest.raises(ValueError, match="float64"):
        resolve_backend("cpu_flash", cpu, torch.float64)

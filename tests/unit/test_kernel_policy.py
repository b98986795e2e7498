"""The device-aware kernel policy (a pure function, tested as a table) and how a call reaches it: the
default ``grad_partials="auto"``, ``device_type`` stating the device a step is modelled on."""
import pytest
import torch

import burstattn
from burstattn.call import Call
from burstattn.kernels import varlen
from burstattn.kernels.policy import KernelPolicy, kernel_policy, resolve_grad_partials
from burstattn.call.engine_adapter import step_policy
from burstattn.strategies.burst import alone
from burstattn.testing.oracle import exact_attention

BF16, F16, F32, F64 = torch.bfloat16, torch.float16, torch.float32, torch.float64

# (device, dtype, backend, mask kind, grad_partials, needs) -> (grad_partials, step, masked, kernel, compute dtype)
TABLE = [
    (("cuda", BF16, "sdpa", "none", "auto", ()), ("kernel", "pair", "dense", "sdpa", BF16)),
    (("cuda", F16, "flash_attn", "none", "auto", ()), ("kernel", "pair", "dense", "flash_attn", F16)),
    (("cuda", BF16, "sdpa", "documents", "auto", ()), ("kernel", "pair", "varlen", "aten_flash", BF16)),
    (("cuda", F16, "sdpa", "window", "auto", ()), ("kernel", "pair", "window", "aten_flash", F16)),
    (("cuda", BF16, "sdpa", "documents+window", "auto", ()), ("kernel", "pair", "varlen", "aten_flash", BF16)),
    (("cuda", BF16, "flash_attn", "documents", "auto", ()), ("kernel", "pair", "varlen", "flash_attn", BF16)),
    (("cuda", BF16, "flash_attn", "window", "auto", ()), ("kernel", "pair", "window", "flash_attn", BF16)),
    (("cuda", BF16, "sdpa", "mask_mod", "auto", ()), ("kernel", "pair", "flex", "flex", BF16)),
    (("cuda", BF16, "sdpa", "mixed", "auto", ()), ("kernel", "pair", "flex", "flex", BF16)),
    (("cuda", F32, "sdpa", "documents", "auto", ()), ("kernel", "pair", "varlen", "aten_efficient", F32)),
    (("cuda", F32, "sdpa", "window", "auto", ()), ("kernel", "pair", "flex", "flex", F32)),
    (("cuda", F32, "sdpa", "none", "auto", ()), ("kernel", "pair", "dense", "sdpa", F32)),
    # float64 and the reference kernel: the engine's tiles everywhere
    (("cuda", F64, "reference", "documents", "auto", ()), ("kernel", "tiles", "tiles", "reference", F64)),
    (("cuda", BF16, "reference", "window", "auto", ()), ("kernel", "tiles", "tiles", "reference", BF16)),
    # the explicit values keep their meaning on a GPU
    (("cuda", BF16, "sdpa", "documents", "float32", ()), ("float32", "tiles", "tiles", "sdpa", F32)),
    (("cuda", BF16, "sdpa", "none", "float32", ()), ("float32", "tiles", "dense", "sdpa", F32)),
    (("cuda", BF16, "sdpa", "documents", "kernel", ()), ("kernel", "pair", "varlen", "aten_flash", BF16)),
    # what the one-call kernels do not take keeps the tiles for masked pairs (dense pairs unchanged)
    (("cuda", BF16, "sdpa", "documents", "auto", ("alibi",)), ("kernel", "pair", "tiles", "sdpa", BF16)),
    (("cuda", BF16, "sdpa", "mask_mod", "auto", ("softcap",)), ("kernel", "pair", "tiles", "sdpa", BF16)),
    (("cuda", BF16, "sdpa", "none", "auto", ("softcap",)), ("kernel", "pair", "dense", "sdpa", BF16)),
    # a step modelled on a GPU with the CPU kernel standing in (a dry run's fake CPU tensors)
    (("cuda", BF16, "cpu_flash", "documents", "auto", ()), ("kernel", "pair", "varlen", "aten_flash", BF16)),
    # the CPU keeps its tiles; "auto" is float32 there
    (("cpu", BF16, "cpu_flash", "none", "auto", ()), ("float32", "tiles", "dense", "cpu_flash", F32)),
    (("cpu", BF16, "cpu_flash", "documents", "auto", ()), ("float32", "tiles", "tiles", "cpu_flash", F32)),
    (("cpu", BF16, "cpu_flash", "documents", "kernel", ()), ("kernel", "tiles", "tiles", "cpu_flash", BF16)),
    (("cpu", F32, "cpu_flash", "mask_mod", "auto", ()), ("float32", "tiles", "tiles", "cpu_flash", F32)),
    (("cpu", F64, "reference", "window", "auto", ()), ("float32", "tiles", "tiles", "reference", F64)),
]


@pytest.mark.parametrize("args, want", TABLE, ids=[f"{a[0]}-{a[1]}-{a[2]}-{a[3]}-{a[4]}-{'+'.join(a[5])}"
                                                   for a, _ in TABLE])
def test_policy_table(args, want):
    device, dtype, backend, kind, gp, needs = args
    p = kernel_policy(device, dtype, backend, kind, gp, frozenset(needs))
    assert isinstance(p, KernelPolicy)
    assert (p.grad_partials, p.step, p.masked, p.kernel, p.compute_dtype) == want
    assert p.one_call == (want[2] in ("varlen", "window", "flex"))
    with pytest.raises(Exception):
        p.step = "tiles"  # frozen


def test_policy_refuses_unknown_values():
    with pytest.raises(ValueError, match="grad_partials must be one of"):
        kernel_policy("cuda", BF16, "sdpa", "none", "fp16")
    with pytest.raises(ValueError, match="mask_kind must be one of"):
        kernel_policy("cuda", BF16, "sdpa", "sliding")
    assert [resolve_grad_partials(d) for d in ("cuda", "cpu", "mps")] == ["kernel", "float32", "float32"]


def test_mask_kinds_name_the_policy_input():
    A = burstattn.AttnMask
    assert A(window=(4, 0)).kind == "window"
    assert A(cu_seqlens=[0, 4, 8]).kind == "documents"
    assert A(cu_seqlens=[0, 4, 8], window=(2, 0)).kind == "documents+window"
    assert A(mask_mod=lambda q, k: q >= k).kind == "mask_mod"
    assert A(mask_mod=lambda q, k: q >= k, window=(2, 0)).kind == "mixed"


def test_grad_partials_defaults_to_auto_and_resolves_by_device():
    assert Call().grad_partials == "auto" and burstattn.BurstOptions().grad_partials == "auto"
    q = torch.zeros(1, 8, 2, 4, dtype=BF16)
    cpu = Call(backend="cpu_flash")
    assert step_policy(cpu, q, q).grad_partials == "float32"
    assert step_policy(Call(backend="cpu_flash", device_type="cuda"), q, q).grad_partials == "kernel"
    # a world of one on a modelled GPU is one dense kernel block (the kernel's own backward), on the CPU not
    assert alone(Call(backend="cpu_flash", device_type="cuda"), q, q)
    assert not alone(cpu, q, q)


def test_device_type_is_checked_on_every_rank():
    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(ValueError, match="device_type must be None or one of"):
        burstattn.burst_attn_func(q, q, q, device_type="tpu")


def test_modelled_gpu_runs_documents_in_one_kernel_call_per_pair(monkeypatch):
    """A call stated on CUDA with real CPU tensors takes the GPU's path: the document mask goes to the varlen
    kernel (its plain-PyTorch stand-in here), one forward and one backward call, exact in float32."""
    counts = {"fwd": 0, "bwd": 0}
    fwd, bwd = varlen.reference_forward, varlen.reference_backward

    def count(name, fn):
        def run(*a, **kw):
            counts[name] += 1
            return fn(*a, **kw)
        return run
    monkeypatch.setattr(varlen, "reference_forward", count("fwd", fwd))
    monkeypatch.setattr(varlen, "reference_backward", count("bwd", bwd))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 40, h, 16, generator=gen, requires_grad=True) for h in (4, 2, 2))
    cu = [0, 7, 30, 40]
    out = burstattn.burst_attn_func(q, k, v, causal=True, cu_seqlens=cu, device_type="cuda")
    dout = torch.randn(out.shape, generator=gen)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    assert counts == {"fwd": 1, "bwd": 1}
    mask = burstattn.AttnMask(cu_seqlens=cu).dense(torch.arange(40), torch.arange(40), 40, True)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref, _ = exact_attention(*leaves, causal=True, mask=mask)
    grads = torch.autograd.grad(ref, leaves, dout.double())
    for got, want in zip((out, dq, dk, dv), (ref, *grads)):
        assert float((got.detach().double() - want).norm() / want.norm()) < 1e-5

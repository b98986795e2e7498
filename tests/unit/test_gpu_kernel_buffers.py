"""What a GPU attention kernel holds, counted alike by the dry run and the planner: flash-attn 2's float32
``dq_accum`` / ``softmax_d`` and, with grouped K/V heads, its expanded dK/dV (``kernels.workspace``); SDPA's
copies of row slices; the dry run's GPU path makes one kernel call per ring step, block op and head group;
SDPA hands grouped K/V heads and ``[B, S, H, D]`` views to PyTorch's flash kernel as they are."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from burstattn.kernels.sdpa import SdpaKernel
from burstattn.kernels.workspace import flash_backward_workspace, kernel_workspace
from burstattn.sim.memory import alone_buffers
from burstattn.train.dryrun import GpuKernel

B, N, HQ, HKV, D = 1, 4096, 32, 8, 128


def test_flash_backward_workspace_per_backend():
    accum = B * N * HQ * D * 4 + B * HQ * N * 4  # float32 dq_accum and softmax_d
    expanded = 2 * B * N * HQ * D * 2  # dk_expanded, dv_expanded [B, n_k, Hq, d] in bf16
    shape = dict(batch=B, q_heads=HQ, q_rows=N, k_rows=N, head_dim=D, element_size=2)
    assert flash_backward_workspace(kv_heads=HKV, **shape) == accum + expanded
    assert flash_backward_workspace(kv_heads=HQ, **shape) == accum  # MHA: nothing expanded
    assert kernel_workspace("flash_attn", kv_heads=HKV, backward=True, copied=123, **shape) == accum + expanded
    assert kernel_workspace("sdpa", kv_heads=HKV, backward=True, copied=123, **shape) == accum + expanded + 123
    assert kernel_workspace("sdpa", kv_heads=HKV, backward=False, **shape) == 0
    assert kernel_workspace("sdpa", kv_heads=HKV, backward=True, **dict(shape, element_size=4)) == 0
    # rows rounded up to 128 and the head size to 32, as mha_bwd allocates them
    assert flash_backward_workspace(batch=1, q_heads=1, kv_heads=1, q_rows=1, k_rows=1, head_dim=8,
                                    element_size=2) == 128 * 32 * 4 + 128 * 4
    with pytest.raises(ValueError, match="backend"):
        kernel_workspace("cpu_flash", kv_heads=HKV, backward=True, **shape)


def test_one_gpu_call_counts_the_expanded_gradients():
    """llama3-8b on one GPU at 815,104 tokens: flash-attn's expanded dK/dV is 12.4 GiB at the backward."""
    n = 815104
    call = dict(batch=1, local_seq=n, q_heads=32, kv_heads=8, head_dim=128, e=2, backward=True)
    extra = alone_buffers(kernel="flash_attn", **call) - alone_buffers(kernel=None, **call)
    assert extra == flash_backward_workspace(batch=1, q_heads=32, kv_heads=8, q_rows=n, k_rows=n, head_dim=128,
                                             element_size=2)
    assert 2 * n * 32 * 128 * 2 / 2**30 == pytest.approx(12.44, abs=0.01) and extra > 12.4 * 2**30


def test_dry_run_kernel_adds_the_gpu_buffers_at_the_cpu_stand_in():
    bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    with FakeTensorMode():
        q, o, g = (torch.empty(1, 8, 256, 64, dtype=torch.bfloat16) for _ in range(3))
        k = torch.empty(1, 2, 256, 64, dtype=torch.bfloat16)
        half = torch.empty(1, 8, 512, 64, dtype=torch.bfloat16)[:, :, :256]  # a row slice: SDPA copies it
        lse = torch.empty(1, 8, 256)
        sdpa, flash = GpuKernel("sdpa"), GpuKernel("flash_attn")
        ws = flash_backward_workspace(batch=1, q_heads=8, kv_heads=2, q_rows=256, k_rows=256, head_dim=64,
                                      element_size=2)
        assert flash(bwd, (g, q, k, k, o, lse)) == ws == sdpa(bwd, (g, q, k, k, o, lse))
        assert sdpa(bwd, (g, half, k, k, o, lse)) == ws + half.nbytes  # the slice's copy (its own rows)
        assert sdpa(fwd, (half, k, k)) == half.nbytes and flash(fwd, (half, k, k)) == 0
        assert sdpa.calls == {"forward": 1, "backward": 2}
    with pytest.raises(ValueError, match="--dry-run-kernel"):
        GpuKernel("cpu_flash")


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.name())
        return func(*args, **(kwargs or {}))


def test_sdpa_takes_grouped_heads_and_bshd_views_as_they_are():
    kern = SdpaKernel(prefer_cudnn=False)  # the flash kernel (what a CPU build's fake tensors can trace)
    with FakeTensorMode():
        q = torch.empty(1, 64, 8, 128, dtype=torch.bfloat16).transpose(1, 2)  # [B, S, H, D] seen as [B, H, S, D]
        k = torch.empty(1, 64, 2, 128, dtype=torch.bfloat16).transpose(1, 2)
        with _Ops() as rec:
            out, lse = kern.forward(q, k, k, 0.1, True)
            dq, dk, dv = kern.backward(out, q, k, k, out, lse, 0.1, True)
        copies = [op for op in rec.ops if op in ("aten::clone", "aten::repeat_interleave", "aten::index_select",
                                                 "aten::expand", "aten::_to_copy", "aten::copy_")]
        assert copies == [], copies
        assert dk.shape == dv.shape == (1, 2, 64, 128) and dq.shape == (1, 8, 64, 128)
        rows = torch.empty(1, 8, 128, 128, dtype=torch.bfloat16)[:, :, 64:]  # a row slice: copied
        with _Ops() as rec:
            kern.forward(rows, k, k, 0.1, False)
        assert "aten::clone" in rec.ops

"""RMSNorm's fused autograd node over rows in chunks (``kernels.base.chunk_rows``: 2,048 rows at dim 4,096)
against float64 plain autograd: one chunk and several (a last chunk shorter), float64 exactly, float32
tightly; and the float32 temporaries of a long shard stay one chunk's (the allocator's peak)."""
from __future__ import annotations

import pytest
import torch

from burstattn.kernels.base import chunk_rows
from burstattn.meter.memory import measure_peak
from burstattn.models.norms import RMSNorm

DIM = 4096


def _reference(x, w, g):
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * w64
    y.backward(g.double())
    return y.detach(), x64.grad, w64.grad


@pytest.mark.parametrize("rows", [100, 2 * chunk_rows(DIM) + 37])
@pytest.mark.parametrize("dtype,bound", [(torch.float64, 1e-14), (torch.float32, 1e-6)])
def test_chunked_norm_matches_float64(rows, dtype, bound):
    gen = torch.Generator().manual_seed(rows)
    norm = RMSNorm(DIM).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(DIM, generator=gen, dtype=dtype) + 0.5)
    x = torch.randn(1, rows, DIM, generator=gen, dtype=dtype).requires_grad_()
    g = torch.randn(1, rows, DIM, generator=gen, dtype=dtype)
    y = norm(x)
    y.backward(g)
    want = _reference(x, norm.weight, g)
    for got, ref in zip((y, x.grad, norm.weight.grad), want):
        assert ((got.double() - ref).norm() / ref.norm()).item() < bound


def test_long_shard_temporaries_stay_one_chunk():
    rows = 4 * chunk_rows(DIM)
    norm = RMSNorm(DIM)
    x = torch.randn(rows, DIM).to(torch.bfloat16).requires_grad_()
    g = torch.randn(rows, DIM).to(torch.bfloat16)
    whole = rows * DIM * 4  # one float32 [rows, dim]

    def step():
        norm(x).backward(g)

    step()
    x.grad = norm.weight.grad = None
    _, peak = measure_peak(step)
    # what must exist: the output and dx (bf16: one float32 [rows, dim] together), rstd; plus a few chunks
    assert peak.peak_bytes < whole + 8 * chunk_rows(DIM) * DIM * 4, (peak.peak_bytes / whole)

"""The rotary embedding's autograd node over positions in chunks (``kernels.base.chunk_rows`` of the
``H x head_dim`` row: 2,048 positions at 32 heads of 128) against float64 plain autograd of the rotate-half
formula (on the model's float32 angles, as HF makes them): one chunk and several (a last chunk shorter), float64 exactly, float32 tightly, and chunked equal to
unchunked bit for bit; the float32 temporaries of a long shard stay one chunk's (the allocator's peak)."""
from __future__ import annotations

import pytest
import torch

from burstattn.kernels.base import chunk_rows
from burstattn.meter.memory import measure_peak
from burstattn.models.rope import _rotate, apply_rotary, rotary_angles

H, HD, THETA = 32, 128, 500000.0
STEP = chunk_rows(H * HD)


def _reference(x, positions, g):
    x64 = x.detach().double().requires_grad_()
    emb = rotary_angles(positions, HD, THETA).double()[None, :, None, :]  # the angles as the model makes them
    x1, x2 = x64.chunk(2, -1)
    y = x64 * emb.cos() + torch.cat([-x2, x1], -1) * emb.sin()
    y.backward(g.double())
    return y.detach(), x64.grad


@pytest.mark.parametrize("n", [100, 2 * STEP + 37])
@pytest.mark.parametrize("dtype,bound", [(torch.float64, 1e-14), (torch.float32, 1e-6)])
def test_chunked_rotary_matches_float64(n, dtype, bound):
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(1, n, H, HD, generator=gen, dtype=dtype).requires_grad_()
    g = torch.randn(1, n, H, HD, generator=gen, dtype=dtype)
    positions = torch.arange(n) + 1000  # a shard's global positions
    y = apply_rotary(x, positions, THETA)
    y.backward(g)
    for got, ref in zip((y, x.grad), _reference(x, positions, g)):
        assert ((got.double() - ref).norm() / ref.norm()).item() < bound


def test_chunks_equal_the_whole_rotation():
    n = 2 * STEP + 37
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, n, H, HD, generator=gen).to(torch.bfloat16)
    positions = torch.arange(n)
    assert torch.equal(apply_rotary(x, positions, THETA), _rotate(x, positions, THETA, 1.0))
    assert torch.equal(apply_rotary(x.requires_grad_(), positions, THETA), _rotate(x, positions, THETA, 1.0))


def test_long_shard_temporaries_stay_one_chunk():
    n = 8 * STEP
    x = torch.randn(1, n, H, HD).to(torch.bfloat16).requires_grad_()
    g = torch.randn(1, n, H, HD).to(torch.bfloat16)
    positions = torch.arange(n)
    whole = n * H * HD * 4  # one float32 copy of x

    def step():
        apply_rotary(x, positions, THETA).backward(g)

    step()
    x.grad = None
    _, peak = measure_peak(step)
    # what must exist: the output and dx (bf16: one float32 copy together); plus a few float32 chunks
    assert peak.peak_bytes < whole + 6 * STEP * H * HD * 4, (peak.peak_bytes / whole)  # unchunked: 5.0 x whole

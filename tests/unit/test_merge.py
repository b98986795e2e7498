"""The log-sum-exp merge against a float64 logsumexp over the concatenated blocks."""
from __future__ import annotations

import pytest
import torch

from burstattn.engine.merge import merge_


def blocks_and_truth(scale: float, seed: int = 0):
    """Random masked scores in key blocks; per-block (o_j, lse_j) and the exact merged result.

    Row 0 sees no key in any block; row 1 none in the first block; row 2 none after the first.
    """
    gen = torch.Generator().manual_seed(seed)
    b, h, s, d, sizes = 2, 3, 7, 5, [4, 1, 6, 3]
    scores = [scale * torch.randn(b, h, s, k, generator=gen, dtype=torch.float64) for k in sizes]
    values = [torch.randn(b, h, k, d, generator=gen, dtype=torch.float64) for k in sizes]
    for j, sc in enumerate(scores):
        keep = torch.rand(s, sc.shape[-1], generator=gen) > 0.3
        keep[0] = False
        keep[1] &= j > 0
        keep[2] &= j == 0
        keep[2, 0] = keep[2, 0] or j == 0
        sc.masked_fill_(~keep, float("-inf"))
    parts = []
    for sc, v in zip(scores, values):
        lse = torch.logsumexp(sc, -1)
        p = torch.exp(sc - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
        parts.append((p @ v, lse))  # rows with no key: o_j = 0, lse_j = -inf
    all_s, all_v = torch.cat(scores, -1), torch.cat(values, -2)
    lse = torch.logsumexp(all_s, -1)
    out = torch.exp(all_s - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1)) @ all_v
    return parts, out, lse


@pytest.mark.parametrize("scale", [1.0, 30.0, 1000.0])
@pytest.mark.parametrize("block_dtype", [torch.float32, torch.bfloat16])
def test_merge_matches_logsumexp_of_concatenated_blocks(scale, block_dtype):
    parts, out_ref, lse_ref = blocks_and_truth(scale)
    out = torch.zeros(out_ref.shape, dtype=torch.float32)
    lse = torch.full(lse_ref.shape, float("-inf"), dtype=torch.float32)
    for o_j, lse_j in parts:
        merge_(out, lse, o_j.to(block_dtype), lse_j.to(torch.float32))
        assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert out.dtype == lse.dtype == torch.float32
    assert torch.isinf(lse[:, :, 0]).all() and (lse[:, :, 0] < 0).all() and (out[:, :, 0] == 0).all()
    tol = 1e-5 if block_dtype == torch.float32 else 1e-2
    finite = torch.isfinite(lse_ref)
    torch.testing.assert_close(lse[finite].double(), lse_ref[finite], rtol=1e-6, atol=1e-5 * scale)
    torch.testing.assert_close(out.double(), out_ref, rtol=tol, atol=tol)


def test_merge_works_on_row_slices_in_place():
    parts, out_ref, lse_ref = blocks_and_truth(1.0, seed=3)
    out = torch.zeros(out_ref.shape, dtype=torch.float32)
    lse = torch.full(lse_ref.shape, float("-inf"), dtype=torch.float32)
    for o_j, lse_j in parts:  # merge the first rows and the rest separately, as the engine does
        merge_(out[:, :, :3], lse[:, :, :3], o_j[:, :, :3].float(), lse_j[:, :, :3].float())
        merge_(out[:, :, 3:], lse[:, :, 3:], o_j[:, :, 3:].float(), lse_j[:, :, 3:].float())
    torch.testing.assert_close(out.double(), out_ref, rtol=1e-5, atol=1e-5)


def test_merge_order_does_not_matter():
    parts, _, _ = blocks_and_truth(5.0, seed=4)
    results = []
    for order in (parts, parts[::-1]):
        out = torch.zeros(parts[0][0].shape, dtype=torch.float32)
        lse = torch.full(parts[0][1].shape, float("-inf"), dtype=torch.float32)
        for o_j, lse_j in order:
            merge_(out, lse, o_j.float(), lse_j.float())
        results.append((out, lse))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results[0][1], results[1][1])

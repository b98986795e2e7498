"""A masked block pair as varlen flash calls: the cum_seq and window values built from the pair's global
positions (documents and windows across shard boundaries, zigzag's two chunks), checked exactly against
the rows' visible key ranges under flash's rule, against the aten ops' schemas and shape functions, and
numerically against float64."""
import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from burstattn.kernels import varlen as vl
from burstattn.kernels.bands import band_ranges, flash_window, pair_bands
from burstattn.kernels.pair import VarlenPair
from burstattn.layouts.named import local_positions
from burstattn.masks.blocks import visible_ranges
from burstattn.masks.pairs import varlen_bands
from burstattn.masks.spec import AttnMask

MASKS = {"window": AttnMask(window=(10, 0)), "window2": AttnMask(window=(7, 5)),
         "docs": AttnMask(cu_seqlens=[0, 5, 40, 41, 96]), "docs+window": AttnMask(cu_seqlens=[0, 30, 70, 96], window=(9, None)),
         "wide": AttnMask(window=(40, 3))}


def _pair(mask, causal, n, world, layout, r, s):
    qp, kp = local_positions(n, r, world, layout), local_positions(n, s, world, layout)
    a, b = visible_ranges(mask, qp, kp, n, causal)
    return a, b, pair_bands(a, b, kp.numel())


def _covered(bands, a, b):
    """Every row that sees something is in exactly one call, with exactly its key range under flash's rule."""
    seen = {}
    for c in bands.calls:
        lo, hi = band_ranges(c)
        rows = [i for x, y in c.q_runs for i in range(x, y)]
        keys = [j for x, y in c.k_runs for j in range(x, y)]
        assert len(rows) == c.cu_q[-1] and len(keys) == c.cu_k[-1]
        for p, i in enumerate(rows):
            assert i not in seen and lo[p] < hi[p]
            seen[i] = (keys[lo[p]], keys[hi[p] - 1] + 1)
            assert hi[p] - lo[p] == seen[i][1] - seen[i][0]  # the packed keys of a row are one run
    want = {i: (int(a[i]), int(b[i])) for i in range(a.numel()) if a[i] < b[i]}
    assert seen == want


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_bands_reproduce_every_rows_keys(layout, world, causal):
    n = 96
    for name, mask in MASKS.items():
        for r in range(world):
            for s in range(world):
                a, b, bands = _pair(mask, causal, n, world, layout, r, s)
                assert bands is not None, (name, r, s)
                _covered(bands, a, b)
                calls = len(bands.calls)
                if name in ("docs", "docs+window") or layout != "zigzag":
                    assert calls <= 1 + (name == "docs+window" and not causal), (name, r, s, calls)
                else:  # a window across zigzag's gap between a rank's two chunks: a rule per side of the gap
                    assert calls <= 3, (name, r, s, calls)


def test_documents_across_shards_exact_values():
    """Contiguous, 2 ranks of 8, documents [0, 3), [3, 11), [11, 16), causal."""
    mask = AttnMask(cu_seqlens=[0, 3, 11, 16])
    _, _, diag = _pair(mask, True, 16, 2, "contiguous", 1, 1)
    (c,) = diag.calls
    assert (c.cu_q, c.cu_k, c.q_runs, c.k_runs, c.window, c.causal) == ((0, 3, 8), (0, 3, 8), ((0, 8),), ((0, 8),),
                                                                        (-1, 0), True)
    _, _, back = _pair(mask, True, 16, 2, "contiguous", 1, 0)  # the document [3, 11) reaches back into rank 0
    (c,) = back.calls
    assert (c.cu_q, c.cu_k, c.q_runs, c.k_runs, c.window) == ((0, 3), (0, 5), ((0, 3),), ((3, 8),), (-1, -1))
    assert (back.rows, back.keys) == ((0, 3), (3, 8))
    assert not _pair(mask, True, 16, 2, "contiguous", 0, 1)[2].calls  # causal: nothing ahead


def test_zigzag_documents_and_window_exact_values():
    """Zigzag, 2 ranks: rank 0 holds positions 0-3 and 12-15, rank 1 4-7 and 8-11."""
    docs = AttnMask(cu_seqlens=[0, 6, 16])
    (c,) = _pair(docs, True, 16, 2, "zigzag", 0, 0)[2].calls
    assert (c.cu_q, c.cu_k, c.q_runs, c.window) == ((0, 4, 8), (0, 4, 8), ((0, 8),), (-1, 0))
    (c,) = _pair(docs, True, 16, 2, "zigzag", 1, 0)[2].calls  # positions 4, 5 see document 0's keys 0-3
    assert (c.cu_q, c.cu_k, c.q_runs, c.k_runs, c.window) == ((0, 2), (0, 4), ((0, 2),), ((0, 4),), (-1, -1))
    (c,) = _pair(docs, True, 16, 2, "zigzag", 0, 1)[2].calls  # positions 12-15 see 6-11 (rank 1's rows 2-7)
    assert (c.cu_q, c.cu_k, c.q_runs, c.k_runs, c.window) == ((0, 4), (0, 6), ((4, 8),), ((2, 8),), (-1, -1))
    window = AttnMask(window=(3, 0))
    (c,) = _pair(window, True, 16, 2, "zigzag", 0, 1)[2].calls  # 12 sees 9-11, 13 sees 10-11, 14 sees 11
    assert (c.cu_q, c.cu_k, c.q_runs, c.k_runs, c.window) == ((0, 3), (0, 3), ((4, 7),), ((5, 8),), (0, -1))


def test_flash_window_normalisation():
    assert flash_window((5, 2), 4) == (-1, 2) and flash_window((3, 4), 4) == (3, -1)  # a side >= max_k: unbounded
    assert flash_window((2, 7), 4, causal_flag=True) == (2, 0)
    assert flash_window((-1, -1), 4) == (-1, -1)


def _pair_inputs(n_q, n_k, dtype, hq=4, hk=2, d=16, batch=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, hq, n_q, d, generator=gen).to(dtype)
    k, v = (torch.randn(batch, hk, n_k, d, generator=gen).to(dtype) for _ in range(2))
    return q, k, v


def _dense(q, k, v, vis, scale):
    g = q.shape[1] // k.shape[1]
    s = q.double() @ k.double().repeat_interleave(g, 1).transpose(-1, -2) * scale
    s = s.masked_fill(~vis, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.masked_fill(lse == -math.inf, 0).unsqueeze(-1))
    return p @ v.double().repeat_interleave(g, 1), lse, p


@pytest.mark.parametrize("layout, world, r, s", [("zigzag", 3, 2, 0), ("zigzag", 3, 0, 2), ("contiguous", 2, 1, 0),
                                                 ("striped", 3, 1, 2), ("zigzag", 2, 1, 1)])
@pytest.mark.parametrize("name", ["docs", "docs+window", "wide"])
def test_pair_forward_and_backward_match_float64(layout, world, r, s, name):
    """The pair's calls (the flash semantics in plain PyTorch, float64 inputs) give the masked pair's
    attention and its gradients under a given global LSE, batch 2 and GQA included."""
    mask, n = MASKS[name], 96
    qp, kp = local_positions(n, r, world, layout), local_positions(n, s, world, layout)
    bands = varlen_bands(mask, True, qp, kp, n)
    q, k, v = _pair_inputs(qp.numel(), kp.numel(), torch.float64)
    vis = mask.dense(qp, kp, n, True)
    scale = 0.25
    ref_out, ref_lse, p = _dense(q, k, v, vis, scale)
    rows, out, lse = VarlenPair("aten_flash").forward(bands, q, k, v, scale)
    keep = torch.isfinite(ref_lse[..., rows])
    assert torch.allclose(out, ref_out[:, :, rows], atol=1e-12)
    assert torch.equal(keep, torch.isfinite(lse)) and torch.allclose(lse[keep], ref_lse[..., rows][keep])
    # backward with a global LSE (this pair's plus another block's) and a global output
    gen = torch.Generator().manual_seed(1)
    lse_g = torch.logaddexp(ref_lse, torch.randn(ref_lse.shape, generator=gen, dtype=torch.float64))
    out_g, dout = (torch.randn(ref_out.shape, generator=gen, dtype=torch.float64) for _ in range(2))
    rs, ks, dq, dk, dv = VarlenPair("aten_flash").backward(bands, dout, q, k, v, out_g, lse_g, scale)
    pg = torch.exp(torch.log(p.clamp_min(1e-300)) + ref_lse.unsqueeze(-1) - lse_g.unsqueeze(-1)) * vis
    g = q.shape[1] // k.shape[1]
    kk, vv = (x.repeat_interleave(g, 1) for x in (k, v))
    ds = pg * (dout @ vv.transpose(-1, -2) - (dout * out_g).sum(-1, keepdim=True))
    ref_dq = ds @ kk * scale
    ref_dk = (ds.transpose(-1, -2) @ q * scale).view(2, k.shape[1], g, -1, 16).sum(2)
    ref_dv = (pg.transpose(-1, -2) @ dout).view(2, k.shape[1], g, -1, 16).sum(2)
    assert torch.allclose(dq, ref_dq[:, :, rs], atol=1e-10)
    assert torch.allclose(dk, ref_dk[:, :, ks], atol=1e-10) and torch.allclose(dv, ref_dv[:, :, ks], atol=1e-10)
    outside = torch.ones(kp.numel(), dtype=torch.bool)
    outside[ks] = False
    assert ref_dk[:, :, outside].abs().max() == 0 if outside.any() else True


def _call_and_tensors(dtype, batch=2):
    bands = varlen_bands(MASKS["docs"], True, local_positions(96, 1, 2, "zigzag"), local_positions(96, 0, 2, "zigzag"), 96)
    c = bands.calls[0]
    q = torch.zeros(batch * c.cu_q[-1], 4, 16, dtype=dtype)
    k = torch.zeros(batch * c.cu_k[-1], 2, 16, dtype=dtype)
    return c, q, k


def test_flash_arguments_match_the_aten_schemas_and_shape_functions():
    c, q, k = _call_and_tensors(torch.bfloat16)
    args, kw = vl.flash_forward_args(c, q, k, k, 0.25, 2)
    assert vl.schema_problem(vl.FLASH_FWD, args, kw) is None
    assert args[3].tolist() == [0] + [x + b * c.cu_q[-1] for b in range(2) for x in c.cu_q[1:]]
    assert args[3].dtype == torch.int32 and (args[5], args[6]) == (c.max_q, c.max_k)
    assert args[8] == c.causal and c.window == (-1, -1) and "window_size_left" not in kw  # documents: no window
    w = varlen_bands(MASKS["wide"], True, *(local_positions(96, 0, 1, "contiguous"),) * 2, 96).calls[0]
    wargs, wkw = vl.flash_forward_args(w, q, k, k, 0.25, 2)
    assert (wkw["window_size_left"], wkw["window_size_right"], wargs[8]) == (*w.window, False) == (40, 0, False)
    assert vl.schema_problem(vl.FLASH_FWD, wargs, wkw) is None
    lse = torch.zeros(4, q.shape[0])
    bargs, bkw = vl.flash_backward_args(c, q, q, k, k, q, lse, 0.25, 2)
    assert vl.schema_problem(vl.FLASH_BWD, bargs, bkw) is None
    with FakeTensorMode(allow_non_fake_inputs=True):  # the ops' own shape functions accept them (GQA native)
        out, lse_out, *_ = torch.ops.aten._flash_attention_forward(*args, **kw)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(*bargs, **bkw)
    assert tuple(out.shape) == tuple(q.shape) and tuple(lse_out.shape) == (4, q.shape[0])
    assert (tuple(dq.shape), tuple(dk.shape)) == (tuple(q.shape), tuple(k.shape))
    # a wrong list is named
    assert "positional" in vl.schema_problem(vl.FLASH_FWD, args + (1,), kw)
    assert "window_size" in vl.schema_problem(vl.FLASH_FWD, args, {"window_size": 3})
    assert "max_q" in vl.schema_problem(vl.FLASH_FWD, args[:5] + (1.5,) + args[6:], kw)


def test_efficient_arguments_match_the_aten_schemas():
    c, q, k = _call_and_tensors(torch.float32)
    qe, ke = q.repeat_interleave(1, 1)[None], k.repeat_interleave(2, 1)[None]
    args, kw = vl.efficient_forward_args(c, qe, ke, ke, 0.25, 2)
    assert vl.schema_problem(vl.EFF_FWD, args, kw) is None and c.window == (-1, -1) and args[9] == 0
    diag = varlen_bands(MASKS["docs"], True, *(local_positions(96, 0, 2, "zigzag"),) * 2, 96).calls[0]
    assert vl.efficient_forward_args(diag, qe, ke, ke, 0.25, 2)[0][9] == 2  # causal from the bottom right
    with FakeTensorMode(allow_non_fake_inputs=True):
        out, lse, *_ = torch.ops.aten._efficient_attention_forward(*args, **kw)
    assert tuple(lse.shape) == (2 * (len(c.cu_q) - 1), 4, math.ceil(c.max_q / 32) * 32)
    rows = torch.randn(4, q.shape[0])
    assert torch.equal(vl.efficient_rows(vl.efficient_lse(rows, c, 2), c, 2), rows)
    bargs, bkw = vl.efficient_backward_args(c, qe, qe, ke, ke, qe, vl.efficient_lse(rows, c, 2), 0.25, 2)
    assert vl.schema_problem(vl.EFF_BWD, bargs, bkw) is None


def test_efficient_kernel_takes_only_causal_or_full_calls():
    full = varlen_bands(MASKS["docs"], False, local_positions(96, 0, 2, "zigzag"), local_positions(96, 1, 2, "zigzag"), 96)
    window = varlen_bands(MASKS["window"], True, local_positions(96, 0, 1, "contiguous"),
                          local_positions(96, 0, 1, "contiguous"), 96)
    assert VarlenPair("aten_efficient").supports(full) and not VarlenPair("aten_efficient").supports(window)
    assert [vl.efficient_mask_type(c) for c in full.calls] == [0]

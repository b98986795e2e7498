"""The GPU path run on the CPU: a world-P plan emulated in one process (every rank's block pairs, the
same plans, kernel choice and merges) with the step modelled on CUDA (``device_type="cuda"``), the
one-call kernels standing in by their plain-PyTorch references. Exact against float64 (float32) and
within flash-attn's rule (bfloat16, the default ``grad_partials``); one kernel call per non-empty pair."""
import warnings

import pytest
import torch

from burstattn.kernels import varlen
from burstattn.kernels.cpu_flash import CpuFlashKernel
from burstattn.kernels.flex import FlexPair, block_mask, dense_reference, flex_call
from burstattn.layouts.named import local_positions
from burstattn.masks.pairs import flex_pair
from burstattn.masks.spec import AttnMask
from burstattn.call.emulated import emulate, emulated_backward, emulated_forward
from burstattn.testing.oracle import exact_attention
from tests.helpers import rel_err, rule_bounds

N = 48
MASKS = {
    "documents": lambda: AttnMask(cu_seqlens=[0, 5, 29, 30, 48]),
    "window": lambda: AttnMask(window=(9, 0)),
    "documents+window": lambda: AttnMask(cu_seqlens=[0, 20, 48], window=(6, 2)),
    "mask_mod": lambda: AttnMask(mask_mod=lambda q, k: ((q - k) % 3 == 0) | (k < 4), block_size=8),
}


def _inputs(dtype, seed=0, hq=4, hk=2, d=16):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(1, N, hq, d), (1, N, hk, d), (1, N, hk, d), (1, N, hq, d)]
    return tuple(torch.randn(s, generator=gen).to(dtype) for s in shapes)


def _run(mask, world, layout, dtype, causal=True, device_type="cuda"):
    q, k, v, dout = _inputs(dtype)
    em = emulate(q, v, world, causal=causal, layout=layout, mask=mask, device_type=device_type)
    out, lse = emulated_forward(em, q, k, v)
    dq, dk, dv = emulated_backward(em, dout, q, k, v, out, lse)
    return em, (q, k, v, dout), dict(out=out, dq=dq, dk=dk, dv=dv)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous", "striped"])
@pytest.mark.parametrize("world", [1, 3, 4])
@pytest.mark.parametrize("kind", list(MASKS))
def test_emulated_gpu_ring_float32_is_exact(layout, world, kind):
    mask = MASKS[kind]()
    em, (q, k, v, dout), got = _run(mask, world, layout, torch.float32)
    assert em.calls[0].pair_kernel is not None  # the one-call path, not the tiles
    vis = mask.dense(torch.arange(N), torch.arange(N), N, True)
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    ref, _ = exact_attention(*leaves, causal=True, mask=vis)
    grads = torch.autograd.grad(ref, leaves, dout.double())
    for name, want in zip(("out", "dq", "dk", "dv"), (ref.detach(), *grads)):
        assert rel_err(got[name], want) < 1e-5, name


@pytest.mark.parametrize("layout, world", [("zigzag", 2), ("zigzag", 3), ("striped", 4), ("contiguous", 3)])
@pytest.mark.parametrize("kind", list(MASKS))
def test_emulated_gpu_ring_bfloat16_within_flash_rule(layout, world, kind):
    mask = MASKS[kind]()
    em, (q, k, v, dout), got = _run(mask, world, layout, torch.bfloat16)
    assert em.calls[0].fp32_grads is False  # grad_partials "auto" on CUDA: the kernel's own partials
    vis = mask.dense(torch.arange(N), torch.arange(N), N, True)
    truth, bounds = rule_bounds(q, k, v, dout, causal=True, mask=vis)
    for name in ("out", "dq", "dk", "dv"):
        err = float((got[name].double() - truth[name].double()).abs().max())
        assert err <= bounds[name], (name, err, bounds[name])


def _counting(monkeypatch):
    counts = {"fwd": 0, "bwd": 0}
    for name, attr in (("fwd", "reference_forward"), ("bwd", "reference_backward")):
        fn = getattr(varlen, attr)

        def run(*a, _fn=fn, _name=name, **kw):
            counts[_name] += 1
            return _fn(*a, **kw)
        monkeypatch.setattr(varlen, attr, run)
    return counts


@pytest.mark.parametrize("layout, world", [("zigzag", 3), ("contiguous", 4), ("striped", 2)])
def test_one_kernel_call_per_nonempty_pair_for_documents(monkeypatch, layout, world):
    """Documents: every non-empty pair of the plan is one forward and one backward call (one head group at
    this size); pairs the mask leaves empty compute nothing."""
    counts = _counting(monkeypatch)
    em, _, _ = _run(MASKS["documents"](), world, layout, torch.bfloat16)
    pairs = sum(1 for plan in em.plans for st in plan.steps for p in st.pairs if p.ops)
    assert pairs > 0 and (layout != "contiguous" or pairs < world * world)  # causal: pairs left empty
    assert counts == {"fwd": pairs, "bwd": pairs}


def test_cpu_keeps_the_tiles(monkeypatch):
    """Without a modelled GPU the masked pairs run the engine's block ops (no varlen call) and the 16-bit
    backward its float32 tiles."""
    counts = _counting(monkeypatch)
    seen = []
    bwd = CpuFlashKernel.backward

    def record(self, dout, q, *a, **kw):
        seen.append(q.dtype)
        return bwd(self, dout, q, *a, **kw)
    monkeypatch.setattr(CpuFlashKernel, "backward", record)
    em, _, _ = _run(MASKS["documents"](), 2, "zigzag", torch.bfloat16, device_type=None)
    assert em.calls[0].pair_kernel is None and counts == {"fwd": 0, "bwd": 0}
    assert seen and set(seen) == {torch.float32}
    seen.clear()
    _run(None, 2, "zigzag", torch.bfloat16, device_type="cuda")  # dense on a modelled GPU: 16-bit partials
    assert seen and set(seen) == {torch.bfloat16}


def test_zigzag_window_across_the_gap_stays_within_three_calls(monkeypatch):
    counts = _counting(monkeypatch)
    em, _, _ = _run(AttnMask(window=(20, 0)), 3, "zigzag", torch.bfloat16)
    pairs = sum(1 for plan in em.plans for st in plan.steps for p in st.pairs if p.ops)
    assert pairs <= counts["fwd"] <= 3 * pairs and counts["bwd"] == counts["fwd"]


def _flex_case(world=1, r=0, s=0):
    # local + global: the first 20 keys and the 6 before each query (tiles of 16: full, partial and empty ones)
    mask = AttnMask(mask_mod=lambda q, k: (k < 20) | (q - k < 6), block_size=16)
    qp, kp = local_positions(64, r, world, "zigzag"), local_positions(64, s, world, "zigzag")
    spec = flex_pair(mask, True, qp, kp, 64)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, qp.numel(), 16, generator=gen)
    k, v = (torch.randn(1, 2, kp.numel(), 16, generator=gen) for _ in range(2))
    vis = mask.dense(qp, kp, 64, True)
    leaves = [x.double().transpose(1, 2) for x in (q, k, v)]
    return spec, (q, k, v), exact_attention(*leaves, mask=vis)


def test_flex_block_mask_forward_matches_float64_on_cpu():
    """The pair's BlockMask (from the block summary) in FlexAttention's eager CPU forward, LSE included,
    and the plain-PyTorch stand-in, against float64."""
    from torch.nn.attention.flex_attention import flex_attention

    spec, (q, k, v), (ref, ref_lse) = _flex_case()
    assert int(spec.full_num.sum()) > 0 and int(spec.kv_num.sum()) > 0  # full and partial tiles both used
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out, lse = flex_call(flex_attention, q, k, v, block_mask(spec, q.device), 16 ** -0.5)
    keep = torch.isfinite(ref_lse)
    assert rel_err(out.transpose(1, 2), ref) < 1e-5
    assert rel_err(lse[keep], ref_lse[keep]) < 1e-5
    out2, lse2 = dense_reference(spec, q, k, v, 16 ** -0.5)
    assert rel_err(out2.transpose(1, 2), ref) < 1e-5 and torch.equal(torch.isfinite(lse2), keep)
    assert FlexPair().forward(spec, q, k, v, 16 ** -0.5)[0] == slice(0, spec.n_q)


@pytest.mark.slow
def test_flex_compiled_forward_matches_float64_on_cpu():
    """The compiled FlexAttention forward (CPU inference: no LSE there) with the pair's BlockMask."""
    from burstattn.kernels.flex import compiled_flex

    spec, (q, k, v), (ref, _) = _flex_case()
    out = compiled_flex()(q, k, v, block_mask=block_mask(spec, q.device), scale=16 ** -0.5, enable_gqa=True)
    assert rel_err(out.transpose(1, 2), ref) < 1e-5


def test_flex_backward_runs_inside_the_custom_op():
    """A float32 window on a modelled GPU goes to FlexAttention through the custom op (the backward
    recomputes the block with autograd inside the op's kernel), exact against float64."""
    import burstattn

    q, k, v, dout = (x.requires_grad_(i < 3) for i, x in enumerate(_inputs(torch.float32)))
    out = burstattn.burst_attn_func(q, k, v, causal=True, window=(9, 0), device_type="cuda")
    grads = torch.autograd.grad(out, (q, k, v), dout)
    vis = AttnMask(window=(9, 0)).dense(torch.arange(N), torch.arange(N), N, True)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref, _ = exact_attention(*leaves, causal=True, mask=vis)
    want = torch.autograd.grad(ref, leaves, dout.double())
    assert rel_err(out.detach(), ref.detach()) < 1e-5
    assert all(rel_err(g, w) < 1e-5 for g, w in zip(grads, want))


def test_flex_pairs_share_one_mask_function_per_shape():
    """Every pair of a mask (same padded shape, same device) hands flex the same mask function, loaded with
    the pair's own positions: the compiled kernel is not recompiled per pair."""
    from burstattn.kernels.flex import flex_slot

    mask = AttnMask(mask_mod=lambda q, k: (k < 20) | (q - k < 6), block_size=16)
    specs = [flex_pair(mask, True, local_positions(64, r, 2, "zigzag"), local_positions(64, s, 2, "zigzag"), 64)
             for r, s in ((0, 0), (1, 0))]
    store: dict = {}
    a = flex_slot(store, specs[0], "cpu")
    b = flex_slot(store, specs[1], "cpu")
    assert a.fn is b.fn and len(store) == 1
    assert torch.equal(b.tensors[0], specs[1].q_pos) and not torch.equal(specs[0].q_pos, specs[1].q_pos)

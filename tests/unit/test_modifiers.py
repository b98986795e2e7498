"""The call options without a process group: the plain kernel's score modifiers and V head
size against the float64 oracle, backend resolution by what a call needs, the one window
validator, tiling of block ops, the K/V message, float32 gradient partials, the sinks' merge."""
from __future__ import annotations

import pytest
import torch

from burstattn.config import normalize_window
from burstattn.engine.merge import add_sinks_, sinks_grad
from burstattn.engine.pairs import BlockOp, MaskKind, tile_op
from burstattn.engine.compute import FP32_TILE, BlockCalls, KVPack
from burstattn.kernels import ScoreMods, get_kernel, resolve_backend
from burstattn.testing.oracle import exact_attention
from tests.helpers import rel_err


def _blocks(b, hq, hkv, sq, sk, d, dv, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(b, hq, sq, d, generator=gen).to(dtype), torch.randn(b, hkv, sk, d, generator=gen).to(dtype),
            torch.randn(b, hkv, sk, dv, generator=gen).to(dtype), torch.randn(b, hq, sq, dv, generator=gen).to(dtype))


@pytest.mark.parametrize("softcap,alibi,dv", [(None, False, 8), (2.0, False, 16), (None, True, 24), (1.5, True, 8)])
@pytest.mark.parametrize("causal", [False, True])
def test_plain_kernel_modifiers_match_oracle(softcap, alibi, dv, causal):
    b, hq, hkv, s, d = 2, 4, 2, 13, 16
    q, k, v, dout = _blocks(b, hq, hkv, s, s, d, dv, seed=dv)
    slopes = torch.rand(b, hq) if alibi else None
    pos = torch.arange(s) + 40  # global positions of a block somewhere in the sequence
    mods = ScoreMods(softcap=softcap, alibi=slopes, q_pos=pos, k_pos=pos)
    kernel = get_kernel("reference")
    out, lse = kernel.forward(q, k, v, 0.3, causal, mods=mods)
    q64, k64, v64 = (x.transpose(1, 2).double().requires_grad_() for x in (q, k, v))
    # the oracle's rows and keys sit at 0..s-1: the same distances |i - j| as the block's at 40..
    ref, ref_lse = exact_attention(q64, k64, v64, causal=causal, softmax_scale=0.3, softcap=softcap,
                                       alibi_slopes=slopes)
    ref.backward(dout.transpose(1, 2).double())
    assert out.shape == (b, hq, s, dv)
    assert rel_err(out, ref.detach().transpose(1, 2)) <= 1e-5 and rel_err(lse, ref_lse.detach()) <= 1e-5
    grads = kernel.backward(dout, q, k, v, ref.detach().transpose(1, 2).float(), ref_lse.detach().float(), 0.3, causal,
                            mods=mods)
    for g, r in zip(grads, (q64.grad, k64.grad, v64.grad)):
        assert g.dtype == torch.float32 and rel_err(g, r.transpose(1, 2)) <= 1e-5


@pytest.mark.parametrize("dv", [8, 24])
def test_cpu_flash_v_head_dim_by_padding(dv):
    q, k, v, dout = _blocks(1, 4, 1, 20, 20, 16, dv, seed=3)
    ref, kern = get_kernel("reference"), get_kernel("cpu_flash")
    o1, l1 = ref.forward(q, k, v, 0.25, True)
    o2, l2 = kern.forward(q, k, v, 0.25, True)
    assert o2.shape == o1.shape and rel_err(o2, o1) <= 1e-5 and rel_err(l2, l1) <= 1e-5
    for a, b in zip(ref.backward(dout, q, k, v, o1, l1, 0.25, True), kern.backward(dout, q, k, v, o1, l1, 0.25, True)):
        assert a.shape == b.shape and rel_err(b, a) <= 1e-5


def test_backends_resolve_by_what_the_call_needs():
    cpu = torch.device("cpu")
    assert resolve_backend("auto", cpu, torch.float32) == "cpu_flash"
    assert resolve_backend("auto", cpu, torch.bfloat16, {"softcap"}) == "reference"
    assert resolve_backend("auto", cpu, torch.float32, {"alibi", "v_head_dim"}) == "reference"
    assert resolve_backend("auto", cpu, torch.float32, {"v_head_dim", "deterministic"}) == "cpu_flash"
    with pytest.raises(ValueError, match=r"'cpu_flash' does not support alibi, softcap on 'cpu'; backends that do: "
                                         r"\['reference'\]"):
        resolve_backend("cpu_flash", cpu, torch.float32, {"softcap", "alibi"})


@pytest.mark.parametrize("window,want", [(None, None), ((-1, -1), None), ((None, None), None), ((-1, 0), (None, 0)),
                                         ((3, -1), (3, None)), ([2, 5], (2, 5)), ((0, 0), (0, 0))])
def test_one_window_validator(window, want):
    assert normalize_window(window) == want


@pytest.mark.parametrize("window,needle", [((-2, 0), "window left must be an int >= 0"), ((1,), "pair"),
                                           ((1.5, 0), "window left"), ((0, True), "window right"), (5, "pair")])
def test_window_validator_errors(window, needle):
    with pytest.raises(ValueError, match=needle):
        normalize_window(window)


@pytest.mark.parametrize("kind", [MaskKind.FULL, MaskKind.PARTIAL, MaskKind.CAUSAL, MaskKind.STRICT])
def test_tile_op_covers_the_op_once(kind):
    n = 10
    op = BlockOp(3, 3 + n, 7, 7 + n, kind)
    tiles = tile_op(op, 4)
    assert all(t.q_stop - t.q_start <= 4 and t.k_stop - t.k_start <= 4 for t in tiles)
    seen = torch.zeros(n, n, dtype=torch.int64)
    for t in tiles:
        block = torch.ones(t.q_stop - t.q_start, t.k_stop - t.k_start, dtype=torch.int64)
        if t.mask in (MaskKind.CAUSAL, MaskKind.STRICT):
            block = block.tril(0 if t.mask is MaskKind.CAUSAL else -1)
        seen[t.q_start - 3:t.q_stop - 3, t.k_start - 7:t.k_stop - 7] += block
    whole = torch.ones(n, n, dtype=torch.int64)
    want = {MaskKind.CAUSAL: whole.tril(), MaskKind.STRICT: whole.tril(-1)}.get(kind, whole)
    assert torch.equal(seen, want)
    assert tile_op(op, n) == (op,)


def test_kv_pack_round_trip():
    k, v = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 6)
    for pair in ((k, k.clone()), (k, v)):
        pack = KVPack(tuple(pair[0].shape), tuple(pair[1].shape))
        buf = pack.pack(*pair)
        assert buf.numel() == pair[0].numel() + pair[1].numel()
        assert all(torch.equal(a, b) for a, b in zip(pack.split(buf), pair))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gradient_partials_are_float32_from_the_first(dtype):
    """16-bit inputs: every partial the backward yields is float32 and at most one tile, also from
    cpu_flash (which returns 16-bit gradients itself); with grad_partials='kernel' they stay 16-bit."""
    n = FP32_TILE + 300
    q, k, v, dout = _blocks(1, 2, 1, n, n, 16, 16, dtype)
    out, lse = get_kernel("cpu_flash").forward(q, k, v, 0.25, True)
    ops = (BlockOp(0, n, 0, n, MaskKind.CAUSAL),)
    kern = get_kernel("cpu_flash")
    calls = BlockCalls(kern, 0.25, fp32_grads=True, tile_elements=1)  # the smallest tiles: FP32_TILE rows
    fp32 = list(calls.backward(ops, dout, q, k, v, out, lse, 0, 0))
    assert len(fp32) == 3 and all(x.dtype == torch.float32 for part in fp32 for x in part[2:])
    assert all(part[0].stop - part[0].start <= FP32_TILE for part in fp32)
    whole = list(BlockCalls(kern, 0.25, fp32_grads=True).backward(ops, dout, q, k, v, out, lse, 0, 0))
    # the same float32 gradients, summed over the tiles in another order
    assert len(whole) == 1 and all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(whole[0][2:], _joined(fp32, n)))
    native = list(BlockCalls(kern, 0.25, fp32_grads=False).backward(ops, dout, q, k, v, out, lse, 0, 0))
    assert len(native) == 1 and native[0][2].dtype == dtype


def _joined(parts, n: int) -> tuple:
    """The tiles' float32 partials of a causal n x n block added into whole dq, dk, dv."""
    dq, dk, dv = (torch.zeros(*parts[0][i].shape[:2], n, parts[0][i].shape[3]) for i in (2, 3, 4))
    for qs, ks, a, b, c in parts:
        dq[:, :, qs] += a
        dk[:, :, ks] += b
        dv[:, :, ks] += c
    return dq, dk, dv


def test_float32_tiles_hold_a_byte_budget():
    """A tile's side is as many rows as ``tile_elements`` hold at the call's B x h x head size, at
    least FP32_TILE: one head group of a long sequence (B 1, 4 heads, d 128) takes 16,384-row tiles."""
    kern = get_kernel("cpu_flash")
    q, v = torch.empty(1, 4, 1, 128), torch.empty(1, 1, 1, 128)
    assert BlockCalls(kern, 1.0, fp32_grads=True).tile(q, v) == 16384
    assert BlockCalls(kern, 1.0, fp32_grads=True, tile_elements=1).tile(q, v) == FP32_TILE


def test_sinks_join_the_merge_once():
    gen = torch.Generator().manual_seed(1)
    scores = torch.randn(2, 3, 5, 7, generator=gen, dtype=torch.float64)
    values = torch.randn(2, 3, 7, 4, generator=gen, dtype=torch.float64)
    sinks = torch.randn(3, generator=gen, dtype=torch.float64, requires_grad=True)
    lse = torch.logsumexp(scores, -1)
    out = torch.softmax(scores, -1) @ values
    add_sinks_(out, lse, sinks.detach())
    full = torch.cat([scores, sinks.view(1, 3, 1, 1).expand(2, 3, 5, 1)], -1)
    ref = torch.softmax(full, -1)[..., :-1] @ values
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, torch.logsumexp(full, -1))
    dout = torch.randn(2, 3, 5, 4, generator=gen, dtype=torch.float64)
    (ref * dout).sum().backward()
    torch.testing.assert_close(sinks_grad(lse, (dout * out).sum(-1), sinks.detach()), sinks.grad)

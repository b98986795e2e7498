"""The one engine's plans, without a process group: block ops from global positions of any lengths
(decoding, continuation), and every schedule's plans checked for "each needed pair exactly once,
each send met by a receive, data present where it is used"."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from burstattn.engine.direct import direct, distflash_steps, pass_q_steps
from burstattn.engine.pairs import BlockOp, MaskKind, ops_from_positions, position_ops
from burstattn.engine.plan import Step, check_plans, local, ring
from burstattn.engine.run import build_plan, head_groups
from burstattn.layouts.named import local_positions
from burstattn.masks.plan import mask_plan
from burstattn.masks.spec import make_mask


def coverage(ops, nq: int, nk: int) -> torch.Tensor:
    """How often each (query row, key row) entry is computed by ``ops`` (int ``[nq, nk]``)."""
    c = torch.zeros(nq, nk, dtype=torch.int64)
    for op in ops:
        h, w = op.q_stop - op.q_start, op.k_stop - op.k_start
        if op.mask is MaskKind.FULL:
            blk = torch.ones(h, w, dtype=torch.int64)
        else:
            assert h == w, op
            blk = torch.ones(h, w, dtype=torch.int64).tril_(0 if op.mask is MaskKind.CAUSAL else -1)
        c[op.q_start:op.q_stop, op.k_start:op.k_stop] += blk
    return c


def assert_exact(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool) -> None:
    ops = position_ops(q_pos, k_pos, causal)
    want = (k_pos[None, :] <= q_pos[:, None]) if causal else torch.ones(len(q_pos), len(k_pos), dtype=torch.bool)
    assert torch.equal(coverage(ops, len(q_pos), len(k_pos)), want.long()), (q_pos, k_pos, ops)


LAYOUT_OPS = {  # the one op per pair of each layout at local length n (module docstring of engine.pairs)
    "contiguous": lambda q, k, n: ((BlockOp(0, n, 0, n, MaskKind.CAUSAL),) if q == k else
                                   (BlockOp(0, n, 0, n, MaskKind.FULL),) if k < q else ()),
    "zigzag": lambda q, k, n: ((BlockOp(0, n, 0, n, MaskKind.CAUSAL),) if q == k else
                               (BlockOp(0, n, 0, n // 2, MaskKind.FULL),) if k < q else
                               (BlockOp(n // 2, n, 0, n, MaskKind.FULL),)),
    "striped": lambda q, k, n: (BlockOp(0, n, 0, n, MaskKind.CAUSAL if k <= q else MaskKind.STRICT),),
}


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_position_ops_of_the_layouts(layout, world, causal):
    """One kernel call per pair, the layouts' known shapes, and exactly the global causal mask."""
    n = 8
    pos = [local_positions(n * world, r, world, layout) for r in range(world)]
    for q in range(world):
        for k in range(world):
            want = LAYOUT_OPS[layout](q, k, n) if causal else (BlockOp(0, n, 0, n, MaskKind.FULL),)
            assert position_ops(pos[q], pos[k], causal) == want
            assert_exact(pos[q], pos[k], causal)


@pytest.mark.parametrize("nk", [1, 2, 7, 64])
def test_decode_one_query_against_any_key_shard(nk):
    for start in (0, 5, 100):
        keys = torch.arange(start, start + nk)
        for q in (start - 1, start, start + nk // 2, start + nk - 1, start + nk, start + 10 * nk):
            assert_exact(torch.tensor([q]), keys, True)
        assert position_ops(torch.tensor([start + nk]), keys, True) == (BlockOp(0, 1, 0, nk, MaskKind.FULL),)


def test_continuation_and_random_positions():
    gen = torch.Generator().manual_seed(0)
    for _ in range(60):
        nk, nq = int(torch.randint(1, 40, (1,), generator=gen)), int(torch.randint(1, 12, (1,), generator=gen))
        keys = torch.sort(torch.randperm(120, generator=gen)[:nk]).values
        assert_exact(keys[-nq:] if nq <= nk else keys, keys, True)           # a continuation's own shard
        assert_exact(torch.arange(keys.max() + 1, keys.max() + 1 + nq), keys, True)  # after the cache
        assert_exact(torch.randint(0, 130, (nq,), generator=gen), keys, True)        # anything


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("travelling", ["kv", "q"])
def test_ring_plans_are_consistent(layout, world, travelling):
    pos = [local_positions(4 * world, r, world, layout) for r in range(world)]
    ops_of = ops_from_positions(pos, pos, True)
    check_plans([ring(r, world, ops_of, travelling) for r in range(world)], ops_of)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 6])
def test_distflash_plans_are_consistent(world):
    pos = [local_positions(4 * world, r, world, "contiguous") for r in range(world)]
    ops_of = ops_from_positions(pos, pos, True)
    plans = [direct(r, distflash_steps(r, world), world, ops_of, 4) for r in range(world)]
    check_plans(plans, ops_of)


@pytest.mark.parametrize("travelling", ["kv", "q"])
def test_masked_direct_plans_are_consistent(travelling):
    world, n = 4, 16
    for mask in (make_mask(window=(5, 0)), make_mask(cu_seqlens=[0, 10, 40, 64])):
        plans = [build_plan(r, world, positions=[local_positions(n * world, s, world, "contiguous")
                                                 for s in range(world)],
                            causal=True, travelling=travelling,
                            mask_plan=mask_plan(mask, True, n * world, world, "contiguous", r))
                 for r in range(world)]
        mp = [mask_plan(mask, True, n * world, world, "contiguous", r) for r in range(world)]
        check_plans(plans, lambda q, k: mp[q].row[k], sides=(travelling,))


def test_decode_and_continuation_rings():
    """Key shards of different lengths; one rank holds a 1-token query (decoding) or every rank a
    short continuation of its own shard."""
    lengths = [5, 1, 17, 3]
    starts = [sum(lengths[:i]) for i in range(4)]
    k_pos = [torch.arange(s, s + n) for s, n in zip(starts, lengths)]
    total = sum(lengths)
    decode = [torch.tensor([total]), torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long),
              torch.empty(0, dtype=torch.long)]
    cont = [kp[-2:] for kp in k_pos]
    for q_pos in (decode, cont):
        ops_of = ops_from_positions(q_pos, k_pos, True)
        for travelling in ("kv", "q"):
            check_plans([ring(r, 4, ops_of, travelling) for r in range(4)], ops_of)
        for q in range(4):
            for k in range(4):
                assert torch.equal(coverage(ops_of(q, k), len(q_pos[q]), len(k_pos[k])),
                                   (k_pos[k][None, :] <= q_pos[q][:, None]).long())


def test_pass_q_continuation_plans_are_consistent():
    """Pass-Q over cache shards of different lengths: every rank's new queries meet every shard once,
    each query block sent to and each partial sent back by its peer in the same step."""
    lengths, new = [5, 1, 17, 3], [2, 0, 3, 1]
    k_pos, q_pos, start = [], [], 0
    for n in lengths:
        k_pos.append(torch.arange(start, start + n))
        start += n
    for m in new:
        q_pos.append(torch.arange(start, start + m))
        start += m
    k_pos = [torch.cat([k, q]) for k, q in zip(k_pos, q_pos)]  # the new tokens join their rank's shard
    ops_of = ops_from_positions(q_pos, k_pos, True)
    check_plans([direct(r, pass_q_steps(r, 4), 4, ops_of, max(new)) for r in range(4)], ops_of, sides=("q",))


def test_decode_local_plan_computes_every_shard_pair_once():
    """A decode step: the replicated query (owner 0) against one rank's cache shard, one step, no moves."""
    k_pos = [torch.arange(0, 7)]
    ops_of = ops_from_positions([torch.tensor([7])], k_pos, True)
    plan = local(0, [0], ops_of)
    check_plans([plan], ops_of)
    assert plan.steps[0].pairs[0].ops == (BlockOp(0, 1, 0, 7, MaskKind.FULL),) and not plan.steps[0].fetch


def test_check_plans_can_fail():
    pos = [local_positions(8, r, 2, "zigzag") for r in range(2)]
    ops_of = ops_from_positions(pos, pos, True)
    plans = [ring(r, 2, ops_of, "kv") for r in range(2)]
    broken = dataclasses.replace(plans[1], steps=(dataclasses.replace(plans[1].steps[0], fetch=()),)
                                 + plans[1].steps[1:])
    with pytest.raises(AssertionError):
        check_plans([plans[0], broken], ops_of)
    twice = dataclasses.replace(plans[0], steps=plans[0].steps + (Step(9, plans[0].steps[0].pairs),))
    with pytest.raises(AssertionError):
        check_plans([twice, plans[1]], ops_of)


def test_head_groups_divide_kv_heads_and_stay_one_for_small_calls():
    assert head_groups(1, 16, 4, 4, 32) == 1
    g = head_groups(1, 4096, 8, 8, 64)
    assert g > 1 and 8 % g == 0
    assert head_groups(1, 1 << 16, 8, 2, 64) in (1, 2) and head_groups(1, 1 << 16, 8, 1, 64) == 1


@pytest.mark.parametrize("heads", [(8, 8), (8, 2)])
@pytest.mark.parametrize("causal", [False, True])
def test_head_groups_give_the_same_result(heads, causal):
    """One rank: the engine's entry points with G head groups equal G = 1 and the float64 reference."""
    from burstattn.engine.compute import BlockCalls
    from burstattn.engine.run import attention_backward, attention_forward
    from burstattn.kernels import get_kernel
    from burstattn.testing.oracle import exact_attention

    hq, hkv = heads
    gen = torch.Generator().manual_seed(1)
    q, dout = (torch.randn(1, 40, hq, 16, generator=gen) for _ in "qo")
    k, v = (torch.randn(1, 40, hkv, 16, generator=gen) for _ in "kv")
    calls = BlockCalls(get_kernel("reference"), 16 ** -0.5)
    results = []
    for groups in (1, 2, hkv):
        plans = [build_plan(0, 1, positions=[torch.arange(40)], causal=causal, travelling=t) for t in ("kv", "q")]
        out, lse = attention_forward(None, plans[0], calls, q, k, v, groups)
        results.append((out, lse, *attention_backward(None, plans[1], calls, dout, q, k, v, out, lse, groups)))
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    ref_out, ref_lse = exact_attention(q64, k64, v64, causal=causal)
    ref_out.backward(dout.double())
    ref = (ref_out, ref_lse, q64.grad, k64.grad, v64.grad)
    for res in results:
        for x, r in zip(res, ref):
            assert x.shape == r.shape and torch.allclose(x.double(), r.detach(), atol=1e-5, rtol=1e-4)

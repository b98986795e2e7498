"""Pure pieces of burstattn.infer without a process group: the placement policy, the partial
attention over one shard merged by LSE (= attention over all keys), the continuation choice."""
from __future__ import annotations

import math

import pytest
import torch

from burstattn.engine.merge import merge_
from burstattn.infer.bytes import choose_continuation, pass_kv_bytes, pass_q_bytes
from burstattn.infer.placement import placement_counts, placement_positions
from burstattn.infer.sharded import partial_attention, replicated_attention


def test_placement_balances_and_is_contiguous():
    assert placement_counts([0, 0, 0], 7) == [3, 2, 2]
    assert placement_counts([5, 8, 6], 1) == [1, 0, 0]
    assert placement_counts([5, 8, 6], 6) == [4, 0, 2]  # fills the short shards first
    for lengths, m in (([3, 1, 4, 1], 9), ([0], 5), ([2, 2], 0)):
        counts = placement_counts(lengths, m)
        after = [a + c for a, c in zip(lengths, counts)]
        assert sum(counts) == m and max(after) - min(after) <= max(max(lengths) - min(lengths), 1)
    pos = placement_positions([1, 0, 0], 10, 5)
    assert torch.equal(torch.cat(pos), torch.arange(10, 15)) and [p.numel() for p in pos] == [1, 2, 2]
    with pytest.raises(ValueError, match=">= 0"):
        placement_counts([0], -1)


def _reference(q, k, v, q_pos, k_pos, scale, window=None):
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double().repeat_interleave(q.shape[2] // k.shape[2], 2)) * scale
    diff = q_pos[:, None] - k_pos[None]
    seen = diff >= 0 if window is None else (diff >= 0) & (diff <= window)
    s = s.masked_fill(~seen, -math.inf)
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v.double().repeat_interleave(q.shape[2] // k.shape[2], 2))


@pytest.mark.parametrize("backend", ["reference", "cpu_flash"])
@pytest.mark.parametrize("window", [None, 5])
def test_partials_over_shards_merge_to_full_attention(backend, window):
    g = torch.Generator().manual_seed(0)
    n, scale = 23, 0.25
    q, k, v = torch.randn(2, n, 4, 8, generator=g), torch.randn(2, n, 2, 8, generator=g), torch.randn(2, n, 2, 8, generator=g)
    q_pos = torch.arange(n)
    shards = [torch.tensor([0, 3, 4, 11, 20]), torch.tensor([1, 2, 5, 6, 7, 8, 9]), torch.arange(10, 23)[torch.arange(13) != 10]]
    out = lse = None
    for pos in shards:
        o, l = partial_attention(q, q_pos, k[:, pos], v[:, pos], pos, scale=scale, backend=backend,
                                 window=None if window is None else (window, 0))
        if out is None:
            out, lse = o.clone(), l.clone()
        else:
            merge_(out, lse, o, l)
    keep = torch.cat(shards)
    ref = _reference(q, k[:, keep], v[:, keep], q_pos, keep, scale, window)
    assert torch.isfinite(out).all()
    assert (out.transpose(1, 2).double() - ref).abs().max() < 1e-5


def test_replicated_attention_without_a_group_is_local_attention():
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(1, 3, 2, 8, generator=g), torch.randn(1, 10, 1, 8, generator=g), torch.randn(1, 10, 1, 8, generator=g)
    out = replicated_attention(q, torch.tensor([7, 8, 9]), k, v, torch.arange(10), scale=0.3, backend="reference")
    ref = _reference(q, k, v, torch.tensor([7, 8, 9]), torch.arange(10), 0.3)
    assert (out.double() - ref).abs().max() < 1e-5


def test_continuation_choice_follows_the_bytes():
    kw = dict(batch=1, world_size=4, q_heads=8, head_dim=64, dtype=torch.bfloat16)
    q = sum(pass_q_bytes(max_new_local=100, **kw).values())
    kv_small = sum(pass_kv_bytes(max_shard=120, kv_heads=1, **{k: v for k, v in kw.items() if k != "q_heads"}).values())
    assert kv_small < q
    assert choose_continuation("auto", max_new_local=100, max_shard=120, kv_heads=1, **kw) == "kv"
    assert choose_continuation("auto", max_new_local=10, max_shard=5000, kv_heads=1, **kw) == "q"
    assert choose_continuation("kv", max_new_local=10, max_shard=5000, kv_heads=1, **kw) == "kv"
    with pytest.raises(ValueError, match="continuation must be one of"):
        choose_continuation("both", max_new_local=1, max_shard=1, kv_heads=1, **kw)

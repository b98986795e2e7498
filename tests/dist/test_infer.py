"""Generation over a sharded KV cache (burstattn.infer) against single-process greedy generation.

Tiny model, worlds 1-4, prompt lengths not divisible by the layouts' units, several prefill
strategies; a second prompt appended by pass-KV, pass-Q or the formula's choice. Checks: tokens
equal token for token; bytes of one decode step and of the continuation equal the formulas
exactly; the shards stay balanced; a K/V budget that one rank cannot hold works on more ranks;
bad input raises on every rank.
"""
from __future__ import annotations

import pytest
import torch

from burstattn.infer.bytes import decode_bytes, pass_kv_bytes, pass_q_bytes
from burstattn.infer.placement import placement_counts
from burstattn.infer.steps import padded_length
from burstattn.strategies import STRATEGIES
from tests.dist.cases import models as ic

L, HQ, HKV, D = 2, 4, 2, 16  # the tiny preset
CASES = [ic.GenCase(1, "burst", continuation="kv"), ic.GenCase(2, "burst", continuation="q"),
         ic.GenCase(2, "tp", prompt_len=11, more_len=40), ic.GenCase(3, "allgather", continuation="kv"),
         ic.GenCase(3, "burst", prompt_len=17, continuation="q"), ic.GenCase(4, "ulysses", more_len=3),
         ic.GenCase(4, "ring", prompt_len=15, continuation="q"), ic.GenCase(4, "rsa", prompt_len=10, more_len=30),
         ic.GenCase(4, "burst", prompt_len=5, new_tokens=1, more_len=2, continuation="kv")]


def expected_continuation(case: ic.GenCase, lengths_before: list[int], mode: str) -> dict:
    p, b = case.world, case.batch
    counts = placement_counts(lengths_before, case.more_len + 1)  # the last generated token comes along
    if p == 1:
        return {}
    if mode == "q":
        ops = pass_q_bytes(batch=b, max_new_local=max(counts), world_size=p, q_heads=HQ, head_dim=D,
                           dtype=torch.float32)
    else:
        after = [a + c for a, c in zip(lengths_before, counts)]
        ops = pass_kv_bytes(batch=b, max_shard=max(after), world_size=p, kv_heads=HKV, head_dim=D,
                            dtype=torch.float32)
    out = {op: L * n for op, n in ops.items()}
    out["token"] = (p - 1) * b * 8
    decode = (case.more_tokens - 1) * L * decode_bytes(batch=b, new_tokens=1, world_size=p, q_heads=HQ, head_dim=D)
    if decode:
        out["decode"] = decode
    return out


def cheaper(case: ic.GenCase, lengths_before: list[int]) -> str:
    counts = placement_counts(lengths_before, case.more_len + 1)
    after = [a + c for a, c in zip(lengths_before, counts)]
    q = sum(pass_q_bytes(batch=case.batch, max_new_local=max(counts), world_size=case.world, q_heads=HQ,
                         head_dim=D, dtype=torch.float32).values())
    kv = sum(pass_kv_bytes(batch=case.batch, max_shard=max(after), world_size=case.world, kv_heads=HKV,
                           head_dim=D, dtype=torch.float32).values())
    return "kv" if kv < q else "q"


@pytest.mark.parametrize("case", CASES, ids=ic.GenCase.id)
def test_generate_and_continue_exact_with_bytes(pools, case):
    ref_first, ref_more = ic.reference_tokens(case)
    results = pools.get(case.world).run(ic.generate_and_continue, case)
    for rank, res in enumerate(results):
        assert torch.equal(res["tokens"], ref_first), (rank, res["tokens"], ref_first)
        assert torch.equal(res["more"], ref_more), (rank, res["more"], ref_more)
        want = case.continuation if case.continuation != "auto" else cheaper(case, res["lengths_before"])
        assert res["mode"] == want, (rank, res["mode"], want)
        one = L * decode_bytes(batch=case.batch, new_tokens=1, world_size=case.world, q_heads=HQ, head_dim=D)
        assert res["decode_sent"] == ({"decode": one} if case.world > 1 else {}), (rank, res["decode_sent"])
        assert res["continuation_sent"] == expected_continuation(case, res["lengths_before"], res["mode"]), (
            rank, res["continuation_sent"], expected_continuation(case, res["lengths_before"], res["mode"]))
    lengths = results[0]["lengths"]
    total = case.prompt_len + case.new_tokens - 1 + case.more_len + case.more_tokens
    assert sum(lengths) == total, (lengths, total)
    prefill = results[0]["lengths_after_prefill"]
    layout = STRATEGIES[case.strategy].default_layout  # zigzag for every strategy: pads up to a multiple of 2P
    pads = padded_length(case.prompt_len, case.world, layout) - case.prompt_len
    assert sum(prefill) == case.prompt_len and max(prefill) - min(prefill) <= max(pads, 1), prefill
    assert max(lengths) - min(lengths) <= max(max(prefill) - min(prefill), 1), lengths


def test_auto_switches_between_pass_q_and_pass_kv():
    """Few new tokens on a long cache: pass-Q; new tokens a large share of it: pass-KV."""
    assert cheaper(ic.GenCase(2, more_len=3), [40, 40]) == "q"
    assert cheaper(ic.GenCase(2, more_len=200), [10, 10]) == "kv"


def test_memory_budget(pools):
    """A prompt whose K/V one rank cannot hold under the budget runs on 2 and 4 ranks, same tokens."""
    n = 40
    case = ic.GenCase(1, prompt_len=n, new_tokens=3, batch=2)
    ref, _ = ic.reference_tokens(case)
    budget = 2 * L * case.batch * 24 * HKV * D * 4  # 24 tokens of K/V per rank, all layers
    single = pools.get(1).run(ic.budget_run, n, budget)[0]
    assert "kv_budget_bytes" in single.get("error", ""), single
    for world in (2, 4):
        for res in pools.get(world).run(ic.budget_run, n, budget):
            assert "error" not in res, res
            assert torch.equal(res["tokens"], ref)
            assert res["local_bytes"] <= budget


@pytest.mark.parametrize("world,what,needle", [
    (1, "empty", "prompt is empty"), (3, "empty", "prompt is empty"),
    (2, "negative", "max_new_tokens must be an int >= 0"),
    (2, "differ", "must be the same on every rank"), (3, "differ_len", "must be the same on every rank")])
def test_bad_input_raises_on_every_rank(pools, world, what, needle):
    for rank, msg in enumerate(pools.get(world).run(ic.bad_input, what)):
        assert needle in msg, (rank, msg)

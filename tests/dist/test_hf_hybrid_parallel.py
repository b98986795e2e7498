"""Hybrid transformers models under context parallelism. Tiny random configs of ten families
(Qwen3-Next, Qwen3.5, OLMo hybrid: Gated DeltaNet; Kimi Linear: KDA; Bamba, Nemotron-H, Granite 4.0 hybrid:
Falcon-H1: Mamba2; MiniMax: lightning attention; LFM2: short convolutions), their mixers made sequence parallel by
burstattn.hf.patch_mixers and their attention through attn_implementation="burst": loss, logits and every
gradient at worlds 2 and 3 against the same model on one process (transformers' own mixers, eager
attention), float32, within 1e-5 of each quantity's scale; packed documents against each document alone;
greedy tokens over a ShardedCache equal transformers' generate; what stays unsupported refused on every
rank, by class name."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers", minversion="5")

from tests.dist.cases import hf_hybrid as hc  # noqa: E402

TOL = 1e-5  # float32 against float32: ~100 ulp of each quantity's scale


def _check(results: list, keys) -> None:
    for rank, res in enumerate(results):
        assert sorted(res) == sorted(keys), res
        for key, r in res.items():
            assert r["count"] > 10 and not r["missing"], (rank, key, r)  # every parameter's gradient
            assert r["loss"] <= TOL and r["logits"] <= TOL and r["grads"] <= TOL, (rank, key, r)


def test_families_exact_world_2(pools):
    results = pools.get(2).run(hc.hybrid_exact, hc.FAMILIES)
    _check(results, [f"{k}:zigzag" for k in hc.FAMILIES])
    # the bytes metered in the models' sharded step are the formulas' (one mixer layer each, batch 2 x 24)
    from burstattn.recurrent import conv_halo_bytes, state_passing_bytes

    lin = hc.LINEAR
    gdn_state = state_passing_bytes(24, 2, "zigzag", batch=2, heads=lin["linear_num_value_heads"],
                                    dk=lin["linear_key_head_dim"], dv=lin["linear_value_head_dim"], matrix=True)
    gdn_halo = conv_halo_bytes(24, 2, "zigzag", batch=2, channels=2 * 2 * 8 + 4 * 8, width=4)
    ssd_state = state_passing_bytes(24, 2, "zigzag", batch=2, heads=8, dk=16, dv=16, matrix=False)  # MAMBA
    ssd_halo = conv_halo_bytes(24, 2, "zigzag", batch=2, channels=2 * 64 + 2 * 16, width=4)
    for res in results:
        for key, state, halo in (("qwen3_next:zigzag", gdn_state, gdn_halo), ("bamba:zigzag", ssd_state, ssd_halo)):
            got = res[key]["bytes"]
            assert (got["state"], got["dstate"], got["halo"], got["dhalo"]) == (
                state["forward"], state["backward"], halo["forward"], halo["backward"]), (key, got)


def test_families_exact_world_3(pools):
    kinds = ("qwen3_next", "kimi_linear", "bamba", "minimax", "lfm2")
    layouts = ("contiguous", "striped")
    _check(pools.get(3).run(hc.hybrid_exact, kinds, layouts), [f"{k}:{lay}" for k in kinds for lay in layouts])


def test_packed_documents_restart_the_recurrences(pools):
    for res in pools.get(2).run(hc.packed, ("qwen3_next", "bamba", "lfm2")):
        for kind, r in res.items():
            assert r["layout"] == "Partition" and r["loss"] <= TOL and r["grads"] <= TOL, (kind, r)


MIXES = "mixes the sequence outside the attention that reaches burstattn"
EXPECTED = {
    "shard:jamba": (MIXES, "JambaMambaMixer", "Mamba (v1)'s selective scan"),
    "unpatched:qwen3_next": (MIXES, "Qwen3NextGatedDeltaNet is sequence parallel after burstattn.hf.patch_mixers"),
    "hand:qwen3_next": ("Qwen3NextGatedDeltaNet in a forward at world size 2 without a burstattn.hf.shard_batch",),
    "generate:minimax": ("MiniMax uses cache of its own",),  # its model refuses any other cache class
}


def test_unsupported_refused_on_every_rank(pools):
    for res in pools.get(2).run(hc.refused, list(EXPECTED)):
        for what, needles in EXPECTED.items():
            for needle in needles:
                assert needle in res[what], (what, res[what])


def test_greedy_tokens_over_a_sharded_cache(pools):
    """Generation: the mixers' conv windows and states replicated in the ShardedCache, the attention's K/V
    sharded; greedy tokens equal transformers' own generate on one process (batch 2, 9 + 5 tokens)."""
    kinds = ("qwen3_next", "kimi_linear", "bamba", "lfm2")
    for res in pools.get(2).run(hc.generate, kinds):
        assert sorted(res) == sorted(kinds), res
        for kind, (tokens, ref) in res.items():
            assert tokens == ref, (kind, tokens, ref)


def test_mamba2_a_log_gradient_within_transformers_float32_error(pools):
    """The float32 ``A_log`` gradient of the sequence-parallel step (64-token segments, world 2) is within
    3x transformers' own float32 error, both against the model computed in float64 throughout: the chunk's
    decays are segment sums, not differences of 64-token cumulative sums (which lost 10-30x)."""
    kinds = ("bamba", "falcon_h1", "granitemoehybrid")
    for rank, res in enumerate(pools.get(2).run(hc.a_log_precision, kinds)):
        for kind in kinds:
            r = res[kind]
            assert r["count"] >= 8 and 0 < r["transformers"] < 1e-4, (rank, kind, r)
            assert r["burstattn"] <= 3 * r["transformers"], (rank, kind, r)

"""The options that move the memory that binds next, against world 1:

* ``offload_optimizer`` (FSDP2's CPUOffloadPolicy: shards, gradients and AdamW state on the host)
  gives the losses and parameters of the run without offload, worlds 1 and 2 (3 AdamW steps, float32);
* ``head_chunks`` (the attention over groups of heads, one after another) likewise, under burst with
  remat (the op's outputs kept per group) and ulysses;
* ``tp`` larger than the kv heads (small-l3: 4 query heads, 1 kv head, at tp 2) replicates the kv
  head (Megatron's way) and matches world 1 under tp-v1 and tp-v3 (with FSDP);
* bad values raise on every rank, naming the flag.
"""
from __future__ import annotations

import pytest

from burstattn.testing.launch import LocalGroupError
from burstattn.train import TrainConfig
from tests.dist.test_train_exact import BASE, LOSS_TOL, PARAM_TOL, _rel
from tests.dist.cases.models import run_training

L3 = BASE.with_overrides(model="small-l3")
CASES = [
    (1, BASE, dict(fsdp=True, offload_optimizer=True)),
    (2, BASE, dict(strategy="burst", fsdp=True, offload_optimizer=True)),
    (2, BASE, dict(strategy="burst", dp=2, fsdp=True, zero=2, offload_optimizer=True, checkpointing="full")),
    (2, BASE, dict(strategy="burst", head_chunks=2, checkpointing="remat")),
    (2, BASE, dict(strategy="ulysses", head_chunks=2)),
    (2, L3, dict(strategy="tp-v1")),
    (2, L3, dict(strategy="tp-v3", fsdp=True, head_chunks=1, checkpointing="full")),
]


@pytest.fixture(scope="module")
def references(pools):
    return {cfg.model: pools.get(1).run(run_training, cfg)[0] for cfg in (BASE, L3)}


@pytest.mark.parametrize("world,base,case", CASES, ids=[f"w{w}-{b.model}-" + "-".join(f"{k}={v}" for k, v in c.items())
                                                        for w, b, c in CASES])
def test_matches_world_one(pools, references, world, base, case):
    reference = references[base.model]
    out = pools.get(world).run(run_training, base.with_overrides(**case))[0]
    for step, (got, want) in enumerate(zip(out["losses"], reference["losses"])):
        assert abs(got - want) <= LOSS_TOL * abs(want), (step, got, want)
    assert out["params"].keys() == reference["params"].keys()
    worst = max((_rel(out["params"][n], reference["params"][n]), n) for n in reference["params"])
    assert worst[0] <= PARAM_TOL, worst


@pytest.mark.parametrize("case,match", [
    (dict(strategy="burst", head_chunks=3), "--head-chunks: head_chunks (3) must divide the kv heads (2)"),
    (dict(strategy="ulysses", head_chunks=4, model="small"), "--head-chunks: head_chunks (4) leaves 1 query heads"),
])
def test_bad_head_chunks_raise_on_every_rank(pools, case, match):
    with pytest.raises(LocalGroupError) as info:
        pools.get(2).run(run_training, BASE.with_overrides(**case))
    assert set(info.value.errors) == {0, 1}
    for err in info.value.errors.values():
        assert "ValueError" in err.type_names and match in err.message, err.message


def test_config_refusals_name_the_flag():
    with pytest.raises(ValueError, match=r"--offload-optimizer.*needs --fsdp"):
        TrainConfig(offload_optimizer=True)
    with pytest.raises(ValueError, match=r"--head-chunks\) must be a positive int"):
        TrainConfig(head_chunks=0)

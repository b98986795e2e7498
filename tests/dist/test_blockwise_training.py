"""The blockwise options in training: 3 AdamW steps with the MLP and the loss in chunks (sizes that
do not divide the local length, and 1), the offload hooks, and all of them together give the
losses and parameters of the same run without them (float32, 1e-6 relative), at worlds 1, 2 and 4,
under burst and ulysses context parallelism, tp-v1 / tp-v3, FSDP over dp x cp and every
checkpointing mode. Each world's runs share one pool call."""
from __future__ import annotations

import pytest

from burstattn.testing.launch import LocalGroupError
from burstattn.train import TrainConfig
from tests.dist.cases.models import blockwise_runs, run_training

# 120 tokens: 60 local rows at cp 2, 30 at cp 4, 30 per tp rank under tp-v3 at tp 2 x cp 2
BASE = TrainConfig(model="tiny", seq_len=120, batch=2, steps=3, lr=1e-3, warmup=1, seed=3, adam_eps=1e-6,
                   targets="answer", mlp_chunk=0, loss_chunk=0)
TOL = 1e-6
ALL = dict(mlp_chunk=7, loss_chunk=1, offload="all")

# world -> [(layout and mode of the reference run, [option sets compared with it])]
GRID = {
    1: [(dict(strategy="burst", checkpointing=m), [dict(mlp_chunk=7), dict(loss_chunk=1), dict(offload="all"), ALL])
        for m in ("none", "remat")],  # full: at world 2 below
    2: [(dict(strategy="burst", checkpointing="remat"), [dict(mlp_chunk=7), dict(mlp_chunk=1), dict(loss_chunk=13),
                                                         dict(loss_chunk=1), dict(offload="inputs"), ALL]),
        (dict(strategy="burst", checkpointing="full"), [ALL]),
        (dict(strategy="burst", checkpointing="none"), [dict(ALL, offload="inputs")]),
        (dict(strategy="ulysses", checkpointing="remat"), [ALL]),
        (dict(strategy="tp-v3", checkpointing="remat"), [dict(mlp_chunk=7), dict(loss_chunk=1), ALL]),
        (dict(strategy="tp-v1", checkpointing="full"), [ALL])],
    4: [(dict(strategy="burst", dp=2, fsdp=True, checkpointing="remat"), [ALL]),
        (dict(strategy="ulysses", fsdp=True, checkpointing="full"), [dict(ALL, offload="inputs")]),
        (dict(strategy="tp-v3", cp=2, fsdp=True, checkpointing="remat"), [ALL, dict(mlp_chunk=4, loss_chunk=11)])],
}
CASES = [(w, i, j) for w, refs in GRID.items() for i, (_, opts) in enumerate(refs) for j in range(len(opts))]


def _name(w, i, j) -> str:
    ref, opts = GRID[w][i]
    return f"w{w}-" + "-".join(f"{k}={v}" for k, v in {**ref, **opts[j]}.items())


@pytest.fixture(scope="module")
def results(pools):
    """Per world: one pool call running every reference and every option set."""
    out = {}
    for world, refs in GRID.items():
        cfgs = [BASE.with_overrides(**ref) for ref, _ in refs]
        cfgs += [BASE.with_overrides(**ref, **o) for ref, opts in refs for o in opts]
        out[world] = pools.get(world).run(blockwise_runs, cfgs)[0]
    return out


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("world,i,j", CASES, ids=[_name(*c) for c in CASES])
def test_option_equals_the_unchunked_run(results, world, i, j):
    runs = results[world]
    refs = GRID[world]
    want = runs[i]
    got = runs[len(refs) + sum(len(o) for _, o in refs[:i]) + j]
    opts = refs[i][1][j]
    assert got["chunks"] == (opts.get("mlp_chunk", 0), opts.get("loss_chunk", 0))
    assert want["chunks"] == (0, 0)
    for step, (a, b) in enumerate(zip(got["losses"], want["losses"])):
        assert abs(a - b) <= TOL * abs(b), (step, a, b)
    assert got["hits"] == want["hits"]
    assert want["host_bytes"] == [0] * BASE.steps
    assert (min(got["host_bytes"]) > 0) == (opts.get("offload", "none") != "none")  # the copies were made
    worst = max((_rel(got["params"][n], want["params"][n]), n) for n in want["params"])
    assert worst[0] <= TOL, worst


def test_worlds_agree_with_the_blockwise_options(results):
    """The chunked runs at worlds 2 and 4 also give world 1's losses (the exactness of the layouts
    themselves is tests/dist/test_train_exact.py's; here with every option on)."""
    one = results[1][len(GRID[1]) + 3 * 0 + 3]["losses"]  # world 1, burst, none, ALL
    for world in (2, 4):
        chunked = results[world][len(GRID[world])]["losses"]  # the first option set of the first reference
        assert chunked == pytest.approx(one, rel=1e-5)


@pytest.mark.parametrize("case,match", [(dict(mlp_chunk=-2), "--mlp-chunk"), (dict(loss_chunk=0.5), "--loss-chunk"),
                                        (dict(offload="nvme"), "--offload")])
def test_bad_options_raise_on_every_rank(pools, case, match):
    with pytest.raises((LocalGroupError, ValueError)) as info:
        pools.get(2).run(run_training, BASE.with_overrides(**case))
    if isinstance(info.value, LocalGroupError):
        assert set(info.value.errors) == {0, 1}
        for err in info.value.errors.values():
            assert "ValueError" in err.type_names and match in err.message, err.message
    else:
        assert match in str(info.value)

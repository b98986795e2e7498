"""The fused blockwise loss (``fused_loss``: each chunk's gradients computed in its forward) against
the unchunked loss: 3 AdamW steps give the losses, answer hits and parameters of the run without
chunks within 1e-6 relative (float32), at worlds 1, 2 and 4, under burst context parallelism,
tp-v1 / tp-v3 (a vocabulary-parallel head), FSDP2, tied embeddings, ``targets`` answer and all
(ignored labels), and gradient accumulation. Each world's runs share one pool call."""
from __future__ import annotations

import pytest

from burstattn.train import TrainConfig
from tests.dist.cases.models import fused_loss_runs

# 120 tokens: 60 local rows at cp 2, 30 at cp 4, 30 per tp rank under tp-v3 at tp 2 x cp 2
BASE = TrainConfig(model="tiny", seq_len=120, batch=2, steps=3, lr=1e-3, warmup=1, seed=5, adam_eps=1e-6,
                   targets="answer", mlp_chunk=0, loss_chunk=0)
TOL = 1e-6
FUSED = [dict(fused_loss=True, loss_chunk=13), dict(fused_loss=True, loss_chunk=1), dict(fused_loss=True)]

# world -> [(plan of the reference run, tie, micro-batches, [fused option sets compared with it])]
GRID = {
    1: [(dict(checkpointing="none"), False, 1, FUSED),
        (dict(checkpointing="remat", targets="all"), True, 1, FUSED[:1]),
        (dict(checkpointing="full", batch=1), False, 2, FUSED[:1])],
    2: [(dict(strategy="burst", checkpointing="remat"), False, 1, FUSED[:2]),
        (dict(strategy="burst", fsdp=True, checkpointing="none", targets="all"), True, 1, FUSED[:1]),
        (dict(strategy="tp-v1", checkpointing="none"), False, 1, FUSED[:2]),
        (dict(strategy="tp-v3", checkpointing="remat", targets="all"), False, 1, FUSED[:2]),
        (dict(strategy="burst", fsdp=True, checkpointing="full", batch=1), False, 2, FUSED[:1])],
    4: [(dict(strategy="burst", dp=2, fsdp=True, checkpointing="remat"), False, 1, FUSED[:1]),
        (dict(strategy="burst", cp=4, checkpointing="none", targets="all"), True, 1, FUSED[1:2]),
        (dict(strategy="tp-v3", cp=2, fsdp=True, checkpointing="remat"), False, 1, FUSED[:2]),
        (dict(strategy="tp-v1", cp=2, checkpointing="full", targets="all"), False, 1, FUSED[:1])],
}
CASES = [(w, i, j) for w, refs in GRID.items() for i, ref in enumerate(refs) for j in range(len(ref[3]))]


def _name(w, i, j) -> str:
    ref, tie, micro, opts = GRID[w][i]
    return f"w{w}-" + "-".join(f"{k}={v}" for k, v in {**ref, **opts[j]}.items()) + ("-tied" if tie else "") + \
        (f"-accum{micro}" if micro > 1 else "")


@pytest.fixture(scope="module")
def results(pools):
    """Per world: one pool call running every reference and every fused option set."""
    out = {}
    for world, refs in GRID.items():
        cases = [(BASE.with_overrides(**ref), tie, micro) for ref, tie, micro, _ in refs]
        cases += [(BASE.with_overrides(**ref, **o), tie, micro) for ref, tie, micro, opts in refs for o in opts]
        out[world] = pools.get(world).run(fused_loss_runs, cases)[0]
    return out


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("world,i,j", CASES, ids=[_name(*c) for c in CASES])
def test_fused_loss_equals_the_unchunked_loss(results, world, i, j):
    runs, refs = results[world], GRID[world]
    want = runs[i]
    got = runs[len(refs) + sum(len(r[3]) for r in refs[:i]) + j]
    assert got["fused"] and not want["fused"]
    for step, (a, b) in enumerate(zip(got["losses"], want["losses"])):
        assert abs(a - b) <= TOL * abs(b), (step, a, b)
    assert got["hits"] == want["hits"]
    worst = max((_rel(got["params"][n], want["params"][n]), n) for n in want["params"])
    assert worst[0] <= TOL, worst

"""The call options (cross-attention, documents, softcap, ALiBi, sinks, V head size) against the float64 oracle at worlds 1-4, forward, LSE and backward (sinks'
gradient included), each alone and combined with windows and documents; every rank's bytes equal
the formula (K and V at their own sizes). fp32 inputs: relative Frobenius error <= 1e-5.

The cases of one world run in one pool call per family (many small cases, one round trip).
"""
from __future__ import annotations

import pytest

from tests.dist.cases import features as fc
from tests.helpers import EXACT

F = fc.FCase
LAYOUTS = ("contiguous", "zigzag", "striped")
TOL = EXACT["float32"]  # fp32 inputs against the float64 oracle (tests/helpers.py's rule)


def lengths(w: int) -> list:
    """Cross-attention and bottom-right causal alignment, every layout, kv layouts of their own."""
    rows = []
    for i, layout in enumerate(LAYOUTS):
        rows += [F(w, nq=6, nk=10, layout=layout, backend=("reference", "cpu_flash")[i % 2], seed=i),
                 F(w, nq=4, nk=12, causal=True, layout=layout, backward=("burst", "kv", "auto")[i], seed=10 + i),
                 F(w, nq=12, nk=4, causal=True, layout=layout, backend="cpu_flash", heads="4/1", seed=20 + i),
                 F(w, nq=8, nk=8, causal=True, layout=layout, kv_layout=LAYOUTS[(i + 1) % 3], seed=30 + i)]
    rows += [F(w, nq=6, nk=10, causal=True, strategy="ring", layout="contiguous", seed=40),
             F(w, nq=8, nk=12, causal=True, docs=((0.25, 0.5, 1.0), (0.5, 0.75, 1.0)), seed=41),
             F(w, nq=8, nk=12, docs=((0.5, 1.0), (0.25, 1.0)), layout="contiguous", backend="cpu_flash", seed=42),
             F(w, nq=10, nk=6, causal=True, docs=((0.6, 1.0), (0.3, 1.0)), layout="striped", backward="kv", seed=43)]
    if w == 4:  # the two-level ring on two "nodes" of two ranks, with a key sequence of its own
        rows += [F(w, nq=4, nk=8, causal=True, schedule="double", backward=b, seed=44 + i)
                 for i, b in enumerate(("burst", "kv"))]
    return rows


def modifiers(w: int) -> list:
    """softcap, ALiBi ([Hq] and [B, Hq]), sinks and a V head size of its own, each alone."""
    return [F(w, softcap=1.5, causal=True, seed=50), F(w, softcap=4.0, layout="striped", backward="kv", seed=51),
            F(w, alibi="heads", causal=True, layout="contiguous", seed=52),
            F(w, alibi="batch", batch=2, backward="burst", seed=53),
            F(w, sinks=True, causal=True, seed=54), F(w, sinks=True, heads="4/1", backward="kv", layout="striped",
                                                      seed=55),
            F(w, dv=8, causal=True, seed=56), F(w, dv=24, backend="cpu_flash", backward="burst", seed=57),
            F(w, dv=8, heads="4/4", causal=True, strategy="ring", seed=58)]


def combined(w: int) -> list:
    """Each feature with a window and with documents, and all of them at once."""
    docs = ((0.4, 1.0), (0.4, 1.0))
    return [F(w, softcap=2.0, window=(3, 0), causal=True, seed=60),
            F(w, alibi="heads", window=(2, 2), layout="striped", seed=61),
            F(w, sinks=True, window=(4, -1), causal=True, backward="kv", seed=62),
            F(w, dv=8, window=(-1, 3), seed=63),
            F(w, nq=6, nk=10, window=(3, 1), causal=True, seed=64),
            F(w, softcap=2.0, docs=docs, causal=True, seed=65),
            F(w, alibi="batch", batch=2, docs=docs, seed=66),
            F(w, sinks=True, docs=docs, causal=True, layout="contiguous", seed=67),
            F(w, dv=24, docs=docs, causal=True, backend="cpu_flash", seed=68),
            F(w, nq=6, nk=10, softcap=3.0, alibi="heads", sinks=True, dv=8, window=(3, 0), causal=True,
              docs=((0.5, 1.0), (0.4, 1.0)), backward="burst", seed=69),
            F(w, nq=6, nk=10, softcap=3.0, alibi="heads", sinks=True, dv=8, window=(4, 1), strategy="ring",
              layout="contiguous", kv_layout="zigzag", seed=70)]


FAMILIES = {"lengths": lengths, "modifiers": modifiers, "combined": combined}


def check(world: int, cases: list, results: list) -> None:
    failures = []
    for i, case in enumerate(cases):
        per_rank = [r[i] for r in results]
        err = fc.errors(case, per_rank)
        bad = {k: v for k, v in err.items() if (v is False) or (not isinstance(v, bool) and v > TOL)}
        for rank, r in enumerate(per_rank):
            if r["sent"] != r["formula"]:
                bad[f"bytes rank {rank}"] = (r["sent"], r["formula"])
        if bad:
            failures.append(f"{case.id()}: {bad}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_features_match_reference_and_formula(pools, world, family):
    cases = FAMILIES[family](world)
    check(world, cases, pools.get(world).run(fc.run_many, cases))


def test_grid_covers_every_feature_at_every_world():
    for world in (1, 2, 3, 4):
        cases = [c for fam in FAMILIES.values() for c in fam(world)]
        assert {c.layout for c in cases} == set(LAYOUTS)
        assert any(c.nq != c.nk and not c.causal for c in cases) and any(c.nq < c.nk and c.causal for c in cases)
        assert any(c.nq > c.nk and c.causal for c in cases) and any(c.kv_layout for c in cases)
        for feature in ("softcap", "alibi", "sinks", "docs", "window"):
            alone = [c for c in cases if getattr(c, feature)]
            assert any(c.window for c in alone) and any(c.docs for c in alone), (world, feature)
        assert any(c.dv < c.d for c in cases) and any(c.dv > c.d for c in cases)
        assert {c.strategy for c in cases} == {"burst", "ring"} and {c.backward for c in cases} >= {"burst", "kv"}

"""How the recurrences' summaries travel, without a process group: which segments are sent (only those
whose document continues on another rank), the log-depth scan's plan (rounds, pruning, what each
rank holds), the formulas, the simulator's threshold and memory term, and an initial state at world 1."""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from burstattn.models import preset
from burstattn.recurrent import SCAN_MIN_WORLD, state_passing_bytes, state_passing_steps
from burstattn.recurrent.scan import plan_runs, scan_plan, zigzag_runs
from burstattn.recurrent.schemes import resolve_scheme
from burstattn.recurrent.segments import segment_plan
from burstattn.sim import recurrent as simrec
from burstattn.sim.activations import STATE_PASSING
from burstattn.sim.hardware import preset as cluster
from burstattn.sim.step import SimConfig, simulate
from tests.dist.cases import hybrid
from tests.dist.cases.hybrid import RecCase
from tests.helpers import EXACT


def _random_cu(N: int, docs: int, seed: int) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [0] + (torch.randperm(N - 1, generator=gen)[:docs - 1] + 1).sort().values.tolist() + [N]


@pytest.mark.parametrize("world,docs", [(4, 64), (8, 200), (3, 17)])
def test_only_segments_touching_a_rank_boundary_are_sent(world, docs):
    N = 64 * world
    plan = segment_plan(N, world, "zigzag", _random_cu(N, docs, world))
    assert plan.max_segments > 4
    for final in (False, True):
        assert plan.max_sent(final) <= 2  # zigzag: two runs per rank, one boundary segment each
        for r in range(world):
            for i in plan.sent(r, final):
                end = int(plan.starts[r][i]) + int(plan.lengths[r][i])  # the position after the segment
                assert bool(plan.run_last[r][i]) and (bool(plan.continues[r][i]) or final and end == N)
    one_doc = segment_plan(N, world, "zigzag")
    assert max(len(one_doc.sent(r)) for r in range(world)) == 2
    per_doc = segment_plan(N, world, "zigzag", list(range(0, N + 1, N // (2 * world))))  # documents = chunks
    assert per_doc.max_sent() == 0 and per_doc.max_sent(final=True) == 1


def _simulate_scan(plan, flags0: list) -> dict:
    """Replay the plan on intervals: the value of run e covers runs [lo, e]; a flagged value is complete."""
    vals = {e: (e, flags0[e]) for e in range(len(plan.owner))}
    for rnd in plan.rounds:
        new = dict(vals)
        for src, dst, full in rnd.moves:
            assert full == (not vals[src][1]) and not vals[dst][1]
            assert dst - src == rnd.distance and vals[dst][0] == src + 1  # the two cover adjacent runs
            new[dst] = (vals[src][0], vals[src][1])
        vals = new
    return vals


@pytest.mark.parametrize("layout,world,docs", [("zigzag", 8, 0), ("zigzag", 16, 40), ("contiguous", 7, 5),
                                               ("striped", 4, 0), ("zigzag", 64, 0)])
def test_scan_plan_reaches_every_document_start_in_log_rounds(layout, world, docs):
    N = 4 * world if layout != "striped" else 2 * world
    seg = segment_plan(N, world, layout, _random_cu(N, docs, 1) if docs else None)
    plan = scan_plan(seg, final=True)
    E = len(plan.owner)
    flags0 = [any(bool(seg.resets[plan.owner[e]][i]) for i in plan.slots[e]) for e in range(E)]
    vals = _simulate_scan(plan, flags0)
    for e in plan.needed:
        if e + 1 < E and plan.needs_in[e + 1] or e == E - 1:
            assert vals[e][1], e  # complete: reaches back to a document start
    assert len(plan.rounds) <= math.ceil(math.log2(E)) if E > 1 else True
    if layout == "zigzag" and not docs:
        assert E == 2 * world - 1 and len(plan.rounds) == math.ceil(math.log2(E))
        for r in range(world):  # a rank sends and receives at most its two runs' values per round
            for rnd in plan.rounds:
                assert sum(plan.owner[d] == r for _, d, _ in rnd.moves) <= 2


def test_scan_sends_nothing_when_every_run_starts_a_document():
    N, world = 64, 4
    cu = list(range(0, N + 1, 4))  # a document starts inside every run
    seg = segment_plan(N, world, "zigzag", cu)
    plan = scan_plan(seg)
    assert plan.rounds == () and all(not n for n in plan.needs_in)
    assert state_passing_bytes(N, world, "zigzag", batch=1, heads=1, dk=2, dv=2, matrix=True, scheme="scan",
                               cu_seqlens=cu) == {"forward": 0, "backward": 0}


def test_zigzag_runs_equal_the_plan_of_the_layout():
    for world in (2, 3, 5, 8, 33):
        for final in (False, True):
            a = scan_plan(segment_plan(2 * world, world, "zigzag"), final)
            b = plan_runs(*_zig(world), final)
            assert (a.owner, a.rounds, a.shift) == (b.owner, b.rounds, b.shift)


def _zig(world):
    owner, flags, needs_in = zigzag_runs(world)
    return owner, (), flags, needs_in


def test_bytes_and_rounds_by_formula():
    kw = dict(batch=1, heads=32, dk=128, dv=128, matrix=True)
    full = 32 * (128 * 128 * 2) * 4
    for world in (2, 4, 64, 256):
        N = 2 * world
        ag = state_passing_bytes(N, world, "zigzag", scheme="allgather", **kw)
        assert ag["forward"] == ag["backward"] == (world - 1) * (1 if world == 2 else 2) * full
        scan = state_passing_bytes(N, world, "zigzag", scheme="scan", **kw)
        steps = state_passing_steps(N, world, "zigzag", scheme="scan")
        assert steps["forward"] <= math.ceil(math.log2(2 * world - 1)) + 1
        assert scan["forward"] <= steps["forward"] * 2 * full  # at most two maps a round
        if world >= 64:
            assert scan["forward"] < ag["forward"] / 4
    assert state_passing_steps(8, 4, "zigzag", scheme="allgather") == {"forward": 1, "backward": 1}


def test_auto_takes_the_scan_from_the_threshold_the_simulator_derives():
    assert simrec.derived_min_world(cluster(simrec.REFERENCE_CLUSTER)) == SCAN_MIN_WORLD
    assert simrec.REFERENCE["hybrid-small"] == simrec.state_shape(preset("hybrid-small"), 1)
    assert resolve_scheme("auto", SCAN_MIN_WORLD) == "scan"
    assert resolve_scheme("auto", SCAN_MIN_WORLD - 1) == "allgather"
    assert resolve_scheme("allgather", 1024) == "allgather"
    hw = cluster("h100-nvlink-ib")
    for s in simrec.REFERENCE.values():  # above its threshold the scan is faster, below it slower
        t = simrec.scan_threshold(s, hw)
        assert simrec.passing_time(s, t, hw, "scan") <= simrec.passing_time(s, t, hw, "allgather")
        assert simrec.passing_time(s, t // 2, hw, "scan") > simrec.passing_time(s, t // 2, hw, "allgather")


def test_scan_memory_does_not_grow_with_cp():
    s = simrec.REFERENCE["qwen3-next-80b"]
    ag = [simrec.passing_memory(s, cp, "allgather") for cp in (64, 128, 256)]
    scan = [simrec.passing_memory(s, cp, "scan") for cp in (64, 128, 256)]
    assert ag[2] / ag[0] > 3.9 and ag[2] == 256 * 2 * s.full + (2 * 256 - 3) * s.state  # 2P maps: 3.0 GB
    assert scan[2] / scan[0] < 1.4 and scan[2] < 2 ** 27  # O(log P) maps
    # the simulator's memory counts them per layer at the planned cp (hybrid-small: 3 recurrent layers)
    m = preset("hybrid-small")
    for cp in (4, 64):
        res = simulate(SimConfig(m, 8192 * cp, cluster("h100-nvlink-ib"), cp=cp, checkpointing="remat"),
                       memory_only=True)
        assert res.memory.phase != "optimizer"
        kept, transient = simrec.kept_bytes(m, batch=1, cp=cp)
        assert kept == 3 * simrec.passing_memory(simrec.state_shape(m, 1), cp) > 0
        assert res.memory.terms.get(STATE_PASSING) in (kept, kept + transient, transient)
    llama = simulate(SimConfig(preset("small"), 256, cluster("h100-nvlink-ib"), cp=4), memory_only=True)
    assert STATE_PASSING not in llama.memory.terms


@pytest.mark.parametrize("kind,scheme", list(itertools.product(["gdn", "kda", "linear", "ssd", "lightning"],
                                                                ["allgather", "scan"])))
def test_initial_state_at_world_one(kind, scheme):
    """Continuing a sequence on one process: output, final state and every gradient (the initial
    state's included) equal the token-by-token recurrence started from it."""
    case = RecCase(kind, "zigzag", "float64", 1, packed=kind in ("gdn", "ssd"), local_seq=12, initial=True,
                   scheme=scheme, seed=7)
    errs = hybrid.recurrence_errors(case)
    assert "dS0" in errs and max(errs.values()) <= EXACT["float64"], errs


def test_dry_run_meters_the_scan_at_the_planned_cp():
    """The dry run of a hybrid at cp 8 takes the scan (scheme "auto") through the fake group, and its
    meter equals the formula for rank 0 times the recurrent layers."""
    from burstattn.train.config import TrainConfig
    from burstattn.train.dryrun import dry_run
    m = preset("hybrid-tiny")
    report = dry_run(TrainConfig(model="hybrid-tiny", seq_len=256, batch=1, steps=1, cp=8, dp=1, tp=1), 8)
    want = state_passing_bytes(256, 8, "zigzag", batch=1, heads=m.linear_num_value_heads, dk=m.linear_key_head_dim,
                               dv=m.linear_value_head_dim, matrix=True, scheme="scan", rank=0)
    layers = simrec.recurrent_layers(m)
    assert report["sent_by_op"]["forward/state"] == layers * want["forward"] > 0
    assert report["sent_by_op"]["backward/dstate"] == layers * want["backward"]

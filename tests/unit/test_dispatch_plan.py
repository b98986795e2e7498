"""The dispatch planner (pure): every sequence placed once on an aligned group of a degree dividing P,
a long-tailed batch balanced better than the fixed mesh, the budget and the parsers' messages."""
from __future__ import annotations

import pytest
import torch

from burstattn.parallel.dispatch import DispatchCost, plan_dispatch
from burstattn.train.dispatch_step import micro_batches
from burstattn.train.documents import DocLengths, SyntheticDocs, load_histogram

COST = DispatchCost.for_model(256, 4, 8, 8, 32, 688, 256)


def _tailed(seed: int = 0, total: int = 32768) -> list[int]:
    return DocLengths.parse("lognormal:256,1.5,16384").sample(total, torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_every_sequence_placed_once_on_an_aligned_group(world):
    lengths = _tailed()
    for mode in ("dynamic", "static"):
        plan = plan_dispatch(lengths, world, COST, mode=mode)
        assert sorted(p.seq for p in plan.placements) == list(range(len(lengths)))
        for p in plan.placements:
            assert world % p.degree == 0 and p.ranks.stop <= world and p.length == lengths[p.seq]
        loads = [sum(p.cost for p in plan.of_rank(r)) for r in range(world)]
        assert loads == pytest.approx(list(plan.loads))


def test_dynamic_balances_a_long_tail_better_than_every_static_cp():
    lengths = _tailed(1)
    dyn = plan_dispatch(lengths, 8, COST)
    assert dyn.balance <= 1.1
    assert 1 in dyn.degrees and max(dyn.degrees) > 1  # short ones alone, the long ones spread
    for cp in (1, 2, 4, 8):
        assert max(dyn.loads) < max(plan_dispatch(lengths, 8, COST, mode="static", cp=cp).loads)


def test_budget():
    plan = plan_dispatch([4000, 100, 100], 4, COST, budget=1000)
    assert all(-(-p.length // p.degree) <= 1000 for p in plan.placements)
    with pytest.raises(ValueError, match=r"document of 4001 tokens exceeds the whole world's memory budget \(4 ranks "
                                         r"x 1000 tokens = 4000 tokens\)"):
        plan_dispatch([4001], 4, COST, budget=1000)
    with pytest.raises(ValueError, match="cp must be a positive divisor of the world size 4"):
        plan_dispatch([10], 4, COST, mode="static", cp=3)


def test_micro_batches_pack_degree_one_runs():
    plan = plan_dispatch([10, 20, 30, 500], 1, COST)
    runs = micro_batches(plan.of_rank(0), 60)
    assert [sum(p.length for p in r) for r in runs] == [500, 60] or sum(len(r) for r in runs) == 4
    assert all(sum(p.length for p in r) <= 60 or len(r) == 1 for r in runs)


def test_synthetic_documents_fill_the_batch():
    docs = SyntheticDocs("lognormal:24,1.2,200", 3, 2, 128).documents(0)
    assert sum(d.numel() for d in docs) == 256 and min(d.numel() for d in docs) >= 2
    assert torch.equal(torch.cat(docs), torch.cat(SyntheticDocs("lognormal:24,1.2,200", 3, 2, 128).documents(0)))


def test_parse_errors_name_the_flag_file_and_line(tmp_path):
    with pytest.raises(ValueError, match="--doc-lengths expects lognormal:MEDIAN,SIGMA,MAX"):
        DocLengths.parse("zipf:1,2")
    good = tmp_path / "h.txt"
    good.write_text("# length count\n1024 10\n131072 2\n")
    assert load_histogram(str(good)) == [(1024, 10), (131072, 2)]
    bad = tmp_path / "bad.txt"
    bad.write_text("1024 10\n2048 x\n")
    with pytest.raises(ValueError, match=rf"{bad}:2: cannot parse '2048 x'") as info:
        load_histogram(str(bad))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("text,expect", [("1024 10\n2048 x\n", ":2: cannot parse '2048 x'"),
                                         ("1024 0\n# none\n2048 0\n", "every count is 0"),
                                         ("0 5\n", "a length must be positive, got 0")])
def test_bench_dispatch_refuses_a_bad_histogram_in_one_line(tmp_path, capsys, text, expect):
    from burstattn.cli import main

    path = tmp_path / "lengths.txt"
    path.write_text(text)
    assert main(["bench", "dispatch", "--simulate", "--histogram", str(path), "--gpus", "8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("burstattn bench dispatch: error: histogram: ") and str(path) in err, err
    assert expect in err and err.count("\n") == 1, err


def test_hf_trainer_dispatch_keyword():
    pytest.importorskip("transformers")
    from burstattn.hf.trainer import ContextParallelTrainer

    # dispatch="dynamic" trains (tests/dist/test_hf_dispatch.py); what it cannot take is refused before anything runs
    with pytest.raises(ValueError, match=r"dispatch='dynamic' chooses every sequence's cp degree itself: drop cp_size"):
        ContextParallelTrainer(dispatch="dynamic", cp_size=2)
    with pytest.raises(ValueError, match=r"dispatch='dynamic' runs strategy burst \| ring \| allgather, got 'usp'"):
        ContextParallelTrainer(dispatch="dynamic", strategy="usp")
    with pytest.raises(ValueError, match=r"dispatch_budget and dispatch_cost are options of dispatch='dynamic'"):
        ContextParallelTrainer(dispatch_budget=64)
    with pytest.raises(ValueError, match=r"dispatch must be one of \('static', 'dynamic'\), got 'sometimes'"):
        ContextParallelTrainer(dispatch="sometimes")


@pytest.mark.parametrize("argv,text", [
    (["--dispatch", "sometimes"], "dispatch (--dispatch) must be one of ('static', 'dynamic')"),
    (["--doc-lengths", "zipf:1"], "--doc-lengths expects lognormal:MEDIAN,SIGMA,MAX"),
    (["--dispatch", "dynamic", "--fsdp"], "--fsdp and --tp > 1 are not supported"),
    (["--dispatch", "dynamic", "--cp", "2"], "--dispatch dynamic chooses every sequence's cp degree itself"),
    (["--dispatch", "dynamic", "--dry-run"], "--dry-run models the fixed mesh's rows"),
])
def test_train_cli_refuses_in_one_line(capsys, argv, text):
    from burstattn.cli import main

    assert main(["train", "--world-size", "2", "--no-progress", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("burstattn train: error: ") and text in err and err.count("\n") == 1, err


def test_simulated_at_scale_beats_the_best_static_cp_with_a_long_tail(tmp_path):
    from bench.dispatch_balance import histogram_table, simulate
    from burstattn.models import preset
    from burstattn.sim.hardware import preset as hw_preset

    model, hw = preset("llama3-8b"), hw_preset("h100-nvlink-ib")
    r = simulate(model, hw, 16, "lognormal:2048,2.0,131072", tokens_per_gpu=16384, budget=32768, steps=2)
    assert r["speedup"] > 1.2 and r["dynamic_tokens_per_gpu"] <= 32768
    assert -(-r["longest"] // r["best_static_cp"]) <= 32768  # the static cp fits the budget too
    flat = simulate(model, hw, 16, "lognormal:8192,0.0,8192", tokens_per_gpu=16384, budget=32768, steps=1)
    assert flat["best_static_cp"] == 1 and flat["speedup"] == pytest.approx(1.0, abs=0.01)  # nothing to gain
    hist = tmp_path / "h.txt"
    hist.write_text("1024 90\n65536 2\n")
    assert "| 8 | histogram |" in histogram_table(str(hist), [8], "llama3-8b", "h100-nvlink-ib", 32768)


def test_file_documents_cut_at_eod_and_offsets(tmp_path):
    from burstattn.train.documents import FileDocs

    ids = torch.arange(1, 65, dtype=torch.int64) % 10  # id 0 every 10 tokens: the end of a document
    path = tmp_path / "t.bin"
    path.write_bytes(ids.to(torch.int16).numpy().tobytes())
    docs = FileDocs(str(path), "uint16", 0, 2, 16, eod_id=0).documents(0)
    assert sum(d.numel() for d in docs) == 32 and all(int(d[-1]) == 0 for d in docs[:-1])
    offsets = tmp_path / "starts.txt"
    offsets.write_text("0\n5\n30\n")
    docs = FileDocs(str(path), "uint16", 0, 1, 64, offsets=str(offsets)).documents(0)
    assert [d.numel() for d in docs] == [5, 25, 34]
    with pytest.raises(ValueError, match="exactly one of --eod-id or --doc-offsets"):
        FileDocs(str(path), "uint16", 0, 1, 64)

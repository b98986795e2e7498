"""``burstattn bench train --max-len``'s pure parts: the doubling + bisection search, the contenders'
training configs, bytes per token, the report and the plot (the search on real steps runs in the
benchmark; tests/dist/test_sim_memory.py measures such steps)."""
from __future__ import annotations

import pytest

from bench.maxlen import search_longest
from bench.train_maxlen import CONTENDERS, MaxLenConfig, per_token, train_config
from bench.train_report import maxlen_markdown, plot_maxlen


def test_search_longest_doubles_then_bisects():
    seen = []

    def fits(n):
        seen.append(n)
        return n <= 11000

    assert search_longest(fits, start=1024, cap=1 << 20, granule=1024, bisect_steps=4) == (10240, None)
    assert seen[:5] == [1024, 2048, 4096, 8192, 16384]
    assert search_longest(lambda n: False, start=1024, cap=4096, granule=1024, bisect_steps=2)[0] is None
    assert search_longest(lambda n: True, start=1024, cap=4096, granule=1024, bisect_steps=2) == (
        4096, "reached the cap N=4096")


def test_contenders_map_to_train_configs():
    cfg = MaxLenConfig(mlp_chunk=512, loss_chunk=256)
    tc, variant = train_config(cfg, "remat+blockwise+offload", 8192)
    assert (tc.checkpointing, tc.mlp_chunk, tc.loss_chunk, tc.offload, tc.seq_len, variant) == (
        "remat", 512, 256, "all", 8192, "lean")
    tc, variant = train_config(cfg, "remat-qkv", 4096)
    assert (tc.mlp_chunk, tc.loss_chunk, variant) == (0, 0, "remat-qkv")
    assert train_config(cfg, "tp-v3:remat+blockwise", 4096)[0].strategy == "tp-v3"
    assert set(cfg.contenders) <= set(CONTENDERS)
    with pytest.raises(ValueError, match="unknown contender"):
        train_config(cfg, "nope", 1024)


def _doc():
    def probe(n, peak, fits=True):
        return dict(seq_len=n, fits=fits, peak_bytes=[peak, peak - 10], maxrss_bytes=[3 * peak] * 2, seconds=1.0,
                    param_bytes=1000, local_tokens=n // 2, host_bytes=[0, 0], chunks=[0, 0])
    recs = [dict(contender="remat-qkv", longest=2048, note=None, probes=[probe(1024, 60000), probe(2048, 110000),
                                                                         probe(4096, 210000, False)]),
            dict(contender="remat+blockwise", longest=16384, note=None,
                 probes=[probe(8192, 52000), probe(16384, 100000), probe(32768, 300000, False)])]
    for r in recs:
        r["bytes_per_token"] = per_token(r)
    return dict(config=MaxLenConfig(budget_mb=0.15).__dict__, records=recs,
                floor=dict(seq_len=16384, saved_per_token=8.0, attention_call_per_token=3.0, per_token=11.0),
                timing=dict(seq_len=2048, contenders={"remat": dict(median_s=2.0, samples=[2.0]),
                                                      "remat+blockwise": dict(median_s=2.1, samples=[2.1]),
                                                      "remat-qkv": dict(median_s=1.9, samples=[1.9])}))


def test_bytes_per_token_report(tmp_path):
    doc = _doc()
    bpt = doc["records"][1]["bytes_per_token"]
    assert bpt["at_longest"] == pytest.approx((100000 - 1000) / 8192)
    assert bpt["slope"] == pytest.approx((100000 - 52000) / (8192 - 4096))
    md = maxlen_markdown(doc)
    assert "remat+blockwise / remat-qkv (the remat before the lean one) longest context: 8.00x" in md
    assert "1.050x the step time" in md and "| remat+blockwise | 16,384 |" in md


def test_maxlen_plot(tmp_path):
    pytest.importorskip("matplotlib")
    assert plot_maxlen(_doc(), tmp_path).stat().st_size > 1000


def test_time_model_of_the_chunked_options_matches_the_committed_run():
    """The simulator on this machine's committed calibration against the committed side-by-side step
    times of ``bench train --max-len`` (bench/results/train/train-maxlen.json): each blockwise
    contender's step time, and its cost over the unchunked twin, within 25%."""
    import json
    from pathlib import Path

    from bench.train_maxlen import time_rows
    from burstattn.sim.hardware import load

    root = Path(__file__).resolve().parents[2] / "bench" / "results"
    doc_path = root / "train" / "train-maxlen.json"
    if not doc_path.exists():
        pytest.skip("no committed bench train --max-len run")
    rows = time_rows(json.loads(doc_path.read_text()), load(str(root / "sim-calibration.json")))
    chunked = [r for r in rows if "cost_measured" in r]
    assert chunked
    for r in chunked:
        assert r["predicted_s"] == pytest.approx(r["measured_s"], rel=0.25), r
        assert r["cost_predicted"] == pytest.approx(r["cost_measured"], rel=0.25), r


def test_a_peak_that_does_not_grow_is_not_compared_with_the_floor():
    """At 64 MiB the step's peak was the same at 2,048 and 4,096 tokens (fixed terms set it), and
    the report said "x floor 0.77", below the floor."""
    def probe(n, peak_mib, fits=True):
        return dict(seq_len=n, fits=fits, peak_bytes=[int(peak_mib * 2**20)] * 2, maxrss_bytes=[600 * 2**20] * 2,
                    seconds=40.0, param_bytes=30_000_000, local_tokens=n // 2, host_bytes=[0, 0], chunks=[512, 256])
    rec = dict(contender="remat+blockwise", longest=4096, note=None,
               probes=[probe(2048, 58.0), probe(4096, 58.1), probe(8192, 99.3, False)])
    rec["bytes_per_token"] = per_token(rec)
    doc = dict(config=MaxLenConfig(budget_mb=64, contenders=("remat+blockwise",)).__dict__, records=[rec],
               floor=dict(seq_len=4096, saved_per_token=8256.0, attention_call_per_token=11056.0, per_token=19312.0))
    md = maxlen_markdown(doc)
    assert "| 0.77 |" not in md and "x floor left out for remat+blockwise" in md, md


def test_each_contender_is_compared_with_its_own_checkpointings_floor():
    from bench.train_memory import floor_bytes

    assert floor_bytes("small-l3", 10, checkpointing="full") < floor_bytes("small-l3", 10)
    doc = _doc()
    doc["records"][0]["contender"] = "full"  # 85,069 B/token at its longest... against full's own floor of 5.0
    doc["floor"]["per_contender"] = {"full": 5.0, "remat+blockwise": 11.0}
    md = maxlen_markdown(doc)
    full = doc["records"][0]["bytes_per_token"]["at_longest"]
    assert f"| {full / 5.0:.2f} |" in md and f"| {full / 11.0:.2f} |" not in md, md


def test_only_the_contenders_asked_for_are_timed(monkeypatch):
    import burstattn.testing.launch as launch
    from bench.train_maxlen import timed_contenders, timing

    cfg = MaxLenConfig(contenders=("remat+blockwise", "full"))
    assert timed_contenders(cfg) == ["remat+blockwise"]
    assert timed_contenders(MaxLenConfig(contenders=("full",))) == []
    assert timed_contenders(MaxLenConfig(contenders=("none", "remat+blockwise"))) == [
        "none", "none+blockwise", "remat+blockwise"]
    seen = []
    monkeypatch.setattr(launch, "run_local", lambda fn, world, pts, *a, **k: seen.extend(p[0] for p in pts) or [
        {p[0]: [1.0] for p in pts}])
    assert set(timing(cfg, 2048)) == {"remat+blockwise"} and seen == ["remat+blockwise"]

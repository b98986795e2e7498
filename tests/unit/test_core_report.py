"""``bench core``'s Markdown when a suite's baseline did not run (``--suites speedup`` alone)."""
from __future__ import annotations

from bench.report import write_markdown


def _speedup_record(name: str, causal: bool) -> dict:
    cfg = dict(suite="speedup", name=name, seq_len=4096, heads=8, kv_heads=8, head_dim=64, causal=causal,
               layout="zigzag", backward="auto", dtype="float32", batch=1, target=1.8, grad_partials="float32")
    times = {"library fwd": 0.17, "library fwd+bwd": 0.59}
    return dict(suite="speedup", name=name, world_size=2, threads_per_rank=1, config=cfg, median_s=times,
                min_s=times, samples_s={k: [[v], [v]] for k, v in times.items()})


def test_speedup_without_the_overhead_suite_reports_times_and_says_why_no_ratio():
    machine = dict(cpu="cpu", cores=2, memory_gib=24, os="linux", python="3.11", torch="2.13", load_avg_1m=0.1)
    doc = dict(benchmark="core", started="2026-12-02T00:00:00", duration_s=60.0, machine=machine, threads=1,
               load_avg_1m_end=0.2, config=dict(repeats=1, warmup=1), records=[_speedup_record("non-causal", False), _speedup_record("causal zigzag", True),
                                          dict(_speedup_record("ceiling", False), suite="ceiling")])
    md = write_markdown(doc)
    assert "| non-causal | - | - | 0.170 s | 0.590 s |" in md
    assert md.count("no world-1 baseline: run the overhead suite too") == 2
    assert "Machine ceiling" not in md


def test_overhead_against_the_kernel_on_the_callers_layout():
    """The overhead suite also times the kernel on views of the caller's ``[B, S, H, D]`` tensors: the ratio
    against it (the call path's own cost) beside the target's ratio against contiguous copies."""
    from bench.core import _derive

    cfg = dict(suite="overhead", name="causal", seq_len=4096, heads=8, kv_heads=8, head_dim=64, causal=True,
               layout="contiguous", backward="auto", dtype="float32", batch=1, target=1.03, grad_partials="float32")
    times = {"library fwd": 0.21, "library fwd+bwd": 0.70, "kernel fwd": 0.20, "kernel fwd+bwd": 0.65,
             "kernel (layout) fwd": 0.21, "kernel (layout) fwd+bwd": 0.70 / 1.004}
    rec = dict(suite="overhead", name="causal", world_size=1, threads_per_rank=1, config=cfg, median_s=times,
               min_s=times, samples_s={k: [[v]] for k, v in times.items()})
    _derive([rec])
    assert abs(rec["overhead"]["fwd+bwd"] - (0.70 / 0.65 - 1)) < 1e-12 and not rec["met"]
    assert abs(rec["overhead_vs_layout"]["fwd+bwd"] - 0.004) < 1e-12
    machine = dict(cpu="cpu", cores=2, memory_gib=24, os="linux", python="3.11", torch="2.13", load_avg_1m=0.1)
    doc = dict(benchmark="core", started="2026-12-05T00:00:00", duration_s=60.0, machine=machine, threads=1,
               load_avg_1m_end=0.2, config=dict(repeats=1, warmup=1), records=[rec])
    md = write_markdown(doc)
    assert "vs the kernel on the caller's layout" in md and "+0.4%" in md, md

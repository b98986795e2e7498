"""One-line messages outside the HF path: the CPU profiler's USDT lines, AttnMask's
``cu_seqlens_q``, document boundaries inside ``torch.compile``, a world-1 Llama with zigzag at an
odd length. No process group."""
from __future__ import annotations

import os

import pytest
import torch

import burstattn
from burstattn.meter.memory import measure_peak


def test_measure_peak_on_cpu_prints_no_usdt_lines_and_keeps_the_callers_stderr(capfd):
    def work():
        os.write(2, b"the caller's own line\n")
        return torch.ones(1000).sum()

    measure_peak(work)
    err = capfd.readouterr().err
    assert "USDT" not in err and "the caller's own line" in err, err


def test_attn_mask_takes_cu_seqlens_q_as_burst_attn_func_does():
    a = burstattn.AttnMask(cu_seqlens_q=[0, 3, 8])
    assert a.bounds.tolist() == [0, 3, 8] and a.fingerprint(8) == burstattn.AttnMask(cu_seqlens=[0, 3, 8]).fingerprint(8)
    b = burstattn.AttnMask(cu_seqlens_q=[0, 3, 8], cu_seqlens_k=[0, 5, 10])
    assert b.keys_bounds.tolist() == [0, 5, 10]
    with pytest.raises(ValueError, match="pass cu_seqlens or cu_seqlens_q"):
        burstattn.AttnMask(cu_seqlens=[0, 8], cu_seqlens_q=[0, 8])


def test_cu_seqlens_inside_fullgraph_compile_says_build_the_mask_outside():
    torch._dynamo.reset()
    q = torch.randn(1, 16, 2, 8)
    cu = torch.tensor([0, 5, 16])
    f = torch.compile(lambda q: burstattn.burst_attn_func(q, q, q, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu),
                      fullgraph=True, backend="eager")
    with pytest.raises(Exception) as info:
        f(q)
    assert "build it outside the compiled function" in str(info.value) and "AttnMask(" in str(info.value), info.value
    mask = burstattn.AttnMask(cu_seqlens=cu)  # the advice works: built outside, passed in
    g = torch.compile(lambda q: burstattn.burst_attn_func(q, q, q, causal=True, mask=mask), backend="eager")
    torch.testing.assert_close(g(q), burstattn.burst_attn_func(q, q, q, causal=True, mask=mask))


def test_world1_llama_with_zigzag_takes_an_odd_length():
    from burstattn.models import preset
    from burstattn.models.llama import AttnCall, Llama

    torch.manual_seed(0)
    m = preset("tiny")
    ids = torch.randint(0, m.vocab_size, (1, 33))
    zig = Llama(m, AttnCall(layout="zigzag"))
    plain = Llama(m, AttnCall(layout="contiguous"))
    plain.load_state_dict(zig.state_dict())
    torch.testing.assert_close(zig(ids, torch.arange(33)), plain(ids, torch.arange(33)))
    default = Llama(m, AttnCall())  # the strategy's default layout (zigzag) too
    default.load_state_dict(zig.state_dict())
    torch.testing.assert_close(default(ids, torch.arange(33)), zig(ids, torch.arange(33)))


def _hf_doc(steps: int, warmup: int) -> dict:
    def row(contender, world, step_s):
        return dict(contender=contender, seq_len=256, world_size=world, threads_per_rank=2 // world,
                    tokens_per_step=256 * (2 if contender == "ddp" else 1), median_step_s=step_s,
                    tokens_per_s=256 * (2 if contender == "ddp" else 1) / step_s, peak_mem_bytes=[2**20, 2**20])
    return dict(config=dict(steps=steps, warmup=warmup), steps=[row("cp-burst", 2, 0.0785), row("single", 1, 1.02),
                                                                row("ddp", 2, 0.0348)])


def test_bench_hf_quick_prints_no_ratio_from_an_untimeable_point_and_says_why():
    from bench.hf_report import steps_table

    quick = "\n".join(steps_table(_hf_doc(steps=1, warmup=0)))
    assert "13.00x" not in quick and "x |" not in quick, quick
    assert "too short to time" in quick and "no warm-up step" in quick and "1 timed step(s)" in quick, quick
    timed = "\n".join(steps_table(_hf_doc(steps=3, warmup=1)))
    assert "12.99x" in timed and "too short to time" not in timed, timed

"""The planner says why nothing runs, searches chunk sizes, prices chunks,
takes ``--dtype``, does not offer CPU offload, names the term that grows; ``sim --timeline`` without
matplotlib. Pure functions, no process group; the CLI in-process."""
from __future__ import annotations

import sys

from burstattn.cli import main


def test_timeline_without_matplotlib_prints_the_result_and_one_line(capsys, monkeypatch, tmp_path):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError (the base install)
    png = tmp_path / "timeline.png"
    assert main(["sim", "--model", "tiny", "--seq-len", "4096", "--gpus", "2", "--timeline", str(png)]) == 0
    out, err = capsys.readouterr()
    assert "time " in out and "peak memory" in out and not png.exists(), out
    assert out.count("pip install 'burstattn[bench]'") == 1 and "Traceback" not in out + err, out + err


def test_nothing_runs_says_which_constraint_excluded_each_configuration(capsys):
    assert main(["plan", "--model", "tiny", "--seq-len", "4096", "--gpus", "3", "--cluster", "a100-pcie-roce",
                 "--mode", "train"]) == 0
    out = capsys.readouterr().out
    assert "nothing fits" not in out and "nothing runs on 3 GPUs at --seq-len 4096" in out, out
    assert "1 x --seq-len 4096 does not divide by 2 x cp" in out and "(e.g. dp=1 cp=3 tp=1)" in out, out
    assert "1 x the model's 4 heads do not divide by tp" in out and "1 x --batch 1 does not divide by dp" in out, out


def test_exclusions_are_data_counted_per_constraint():
    from burstattn.models.config import preset as model_preset
    from burstattn.sim.feasible import exclusions

    got = {e.constraint: e.count for e in exclusions(model_preset("tiny"), 6, 8, 4096, 1)}
    # the 9 (cp, tp) of 6 GPUs: tp 3 (cp 1, 2) and tp 6 do not divide 4 heads; cp 3 (tp 1, 2) and cp 6 do not
    # split 4,096 tokens into 2 x cp chunks; the rest have dp > 1 (6, 3, 3) against --batch 1
    assert got == {"tp-heads": 3, "batch-dp": 3, "seq-split": 3}


import dataclasses  # noqa: E402
import json  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from burstattn.models.config import preset as model_preset  # noqa: E402
from burstattn.sim.hardware import load, preset  # noqa: E402
from burstattn.sim.planner import MemoryChoice, max_seq_len, memory_choices  # noqa: E402
from burstattn.sim.step import SimConfig, memory_model, simulate  # noqa: E402

SMALL_MEM = preset("a100-nvlink-ib").with_overrides(gpu_mem_gib=0.125)
CPU_SPEC = "bench/results/sim-calibration.json"


def test_max_seq_len_searches_chunk_sizes():
    """small-l3 on 2 GPUs of 0.125 GiB: the automatic chunks stopped at 1,024 tokens ('chunks 0/0'); the
    fixed 512 / 256 that bench train --max-len used (no head chunks, no optimizer offload) give 8,192 in bf16
    (10,240 before the attention backward's float32 tile copies were counted: sim.memory.tile_bytes, checked
    against the dry run; 9,216 before the layer's backward counted the residual's gradient and its kept
    tensors back from the host, found by the one-GPU dry run at 522K tokens); the search finds at least that."""
    model = model_preset("small-l3")
    fixed = max_seq_len(model, 2, SMALL_MEM, labels=("burst",), fixed=MemoryChoice(512, 256, offload_optimizer=False, head_chunks=1))["burst"]
    found = max_seq_len(model, 2, SMALL_MEM, labels=("burst",))["burst"]
    assert fixed["tokens"] == 8192
    assert found["tokens"] >= fixed["tokens"] and found["options"]["mlp_chunk"] and found["options"]["loss_chunk"], found


def test_chunk_search_is_the_fewest_chunks_that_fit():
    from burstattn.sim.chunks import frugal, ladder, search_chunks

    assert ladder(1000) == [512, 256, 128, 64] and ladder(64) == [0] and ladder(1000, fixed=300) == [300]
    assert frugal(1000) == (64, 64)
    # fits when at most 300 + 100 rows are held at once: the fewest chunks are 256 / 128 (4 + 8 chunks)
    assert search_chunks(lambda m, x: m + x <= 400, 1000) == (256, 128)
    assert search_chunks(lambda m, x: False, 1000) is None


def test_binds_names_the_term_that_grows_with_the_sequence():
    from burstattn.sim.memory import Memory, growing

    fit = Memory(1.0, 1.0, 50.0, 10.0, 5.0, 0.0, 80.0)
    over = Memory(1.0, 1.0, 50.0, 12.0, 19.0, 0.0, 80.0)
    assert over.binding() == "optimizer state" and growing(fit, over) == "attention call"
    res = max_seq_len(model_preset("small-l3"), 2, SMALL_MEM, labels=("allgather",))["allgather"]
    assert res["binding"] not in ("optimizer state", "weights"), res


def _cfg(**kw):
    base = dict(model=model_preset("llama-7b"), seq_len=1 << 20, hw=preset("a100-nvlink-ib"), cp=8,
                checkpointing="full", fsdp=True)
    return SimConfig(**{**base, **kw})


def test_chunks_are_priced_per_chunk():
    one = simulate(_cfg(mlp_chunk=1, loss_chunk=1))
    usual = simulate(_cfg(mlp_chunk=4096, loss_chunk=256))
    whole = simulate(_cfg())
    assert whole.breakdown["chunk_overhead_s"] == 0 < usual.breakdown["chunk_overhead_s"]
    # 32 layers x 131,071 extra one-token MLP chunks, each at least its fixed cost
    hw = _cfg().hw
    assert one.breakdown["chunk_overhead_s"] >= 32 * ((1 << 17) - 1) * hw.chunk_cost_s
    assert one.time_s > 2 * usual.time_s, (one.time_s, usual.time_s)


def test_the_cpu_spec_carries_a_measured_chunk_cost_and_the_presets_a_derived_one():
    from burstattn.sim.hardware import CHUNK_KERNELS

    cpu = load(CPU_SPEC)
    assert cpu.chunk_overhead_s is not None and cpu.chunk_cost_s == cpu.chunk_overhead_s > 0
    gpu = preset("h100-nvlink-ib")
    assert gpu.chunk_overhead_s is None and gpu.chunk_cost_s == CHUNK_KERNELS * gpu.kernel_overhead_s


def test_dtype_float32_is_priced_as_float32(capsys):
    import json

    def run(dtype):
        assert main(["sim", "--model", "llama-7b", "--seq-len", "32768", "--gpus", "8", "--dtype", dtype,
                     "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    f32, bf16 = run("float32"), run("bfloat16")
    params = model_preset("llama-7b").num_params()
    # without FSDP the weights are cast to bf16 and AdamW's two moments follow them (burstattn.train.job)
    assert bf16["memory"]["optimizer"] == pytest.approx(4 * params, rel=1e-6)
    assert f32["memory"]["optimizer"] == pytest.approx(8 * params, rel=1e-6)  # two moments, no master copy
    assert f32["memory"]["params"] == pytest.approx(2 * bf16["memory"]["params"], rel=1e-6)
    assert f32["compute_s"] > 5 * bf16["compute_s"]  # A100: 19.5 TFLOP/s float32 against 312 bf16
    assert main(["plan", "--model", "tiny", "--seq-len", "4096", "--gpus", "2", "--dtype", "float32"]) == 0
    assert "--dtype float32" in capsys.readouterr().out


def test_offload_is_not_offered_or_counted_where_host_memory_is_device_memory():
    cpu = load(CPU_SPEC)
    assert cpu.host_is_device and not preset("a100-nvlink-ib").host_is_device
    assert {c["offload"] for c in memory_choices("train", MemoryChoice(), cpu)} == {"none"}
    assert {c["offload"] for c in memory_choices("train", MemoryChoice(), preset("a100-nvlink-ib"))} > {"none"}
    base = dict(model=model_preset("small-l3"), seq_len=8192, hw=cpu, cp=2, checkpointing="remat",
                dtype=torch.float32)
    kept, moved = memory_model(SimConfig(**base)), memory_model(SimConfig(**base, offload="all"))
    assert moved.peak == kept.peak and moved.host == 0
    gpu = dict(base, hw=dataclasses.replace(cpu, host_is_device=False))
    assert memory_model(SimConfig(**gpu, offload="all")).peak < memory_model(SimConfig(**gpu)).peak


def test_optimizer_offload_is_not_offered_or_counted_where_host_memory_is_device_memory(capsys):
    """The calibrated CPU spec: FSDP2's CPUOffloadPolicy frees nothing where the host is the device, so the
    planner does not offer it (nor the longest-sequence search) and a fixed one keeps the state on the device."""
    cpu = load(CPU_SPEC)
    assert not any(c["offload_optimizer"] for c in memory_choices("train", MemoryChoice(), cpu))
    assert any(c["offload_optimizer"] for c in memory_choices("train", MemoryChoice(), preset("a100-nvlink-ib")))
    base = dict(model=model_preset("small"), seq_len=4096, hw=cpu, cp=2, checkpointing="full", fsdp=True,
                dtype=torch.float32)
    kept, moved = memory_model(SimConfig(**base)), memory_model(SimConfig(**base, offload_optimizer=True))
    assert moved.peak == kept.peak and moved.host == 0
    gpu = dict(base, hw=dataclasses.replace(cpu, host_is_device=False))
    assert memory_model(SimConfig(**gpu, offload_optimizer=True)).peak < memory_model(SimConfig(**gpu)).peak
    assert main(["plan", "--cluster", CPU_SPEC, "--model", "small", "--gpus", "2", "--dtype", "float32",
                 "--gpu-mem-gib", "0.125", "--max-seq-len", "--json"]) == 0
    options = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["options"]
    assert options and not any(v["offload_optimizer"] for v in options.values()), options

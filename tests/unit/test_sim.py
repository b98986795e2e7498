"""The simulator without a process group: cost models against their formulas, the replayed plans'
bytes against the library's byte formulas, the symmetry shortcut against the full replay, memory,
the planner's feasibility cut, the command line (JSON keys, clear errors) and its speed."""
from __future__ import annotations

import dataclasses
import json
import math
import time

import pytest
import torch

from burstattn.cli import main
from burstattn.formulas import distflash_bytes, double_bytes
from burstattn.models.config import preset as model_preset
from burstattn.sim import net, plans
from burstattn.sim.attention import AttnShape, attention_timeline
from burstattn.sim.hardware import PRESETS, ClusterHW, preset
from burstattn.sim.planner import max_seq_len, plan
from burstattn.sim.step import SimConfig, memory_model
from burstattn.strategies import STRATEGIES

HW = ClusterHW("test", 4, 100e12, 0.5, 0.5, 0.5, 1.0, 1e30, 80e9, intra_bw=100e9, intra_lat=2e-6,
               inter_bw=10e9, inter_lat=7e-6, inter_shared=True)


def test_presets_have_sources_and_cluster_shares_them():
    from burstattn.cluster.spec import REAL

    assert set(PRESETS) == {"a100-pcie-roce", "a100-nvlink-ib", "h100-nvlink-ib", "h200-nvlink-ib", "tpuv4"}
    for hw in PRESETS.values():
        assert {"peak_flops", "intra_bw", "inter_bw", "mem_bytes"} <= set(hw.sources), hw.name
    assert REAL["a100-pcie-roce"] == dict(flops=300e12, intra=12e9, inter=25e9, intra_lat=10e-6, inter_lat=5e-6)
    assert REAL["h100-nvlink-ib"] == dict(flops=700e12, intra=450e9, inter=50e9, intra_lat=2e-6, inter_lat=5e-6)


def test_ring_all_reduce_and_all_gather_cost_what_the_formula_says():
    nbytes = 64e6
    for p in (2, 4):  # one node: per-device links
        pl = net.placement(HW, p)
        assert net.ring_all_reduce_time(pl, nbytes) == pytest.approx(2 * (p - 1) * (2e-6 + nbytes / p / 100e9))
        assert net.all_gather_time(pl, nbytes) == pytest.approx((p - 1) * (2e-6 + nbytes / 100e9))
        tree = 2 * math.ceil(math.log2(p)) * 2e-6 + 2 * nbytes / 100e9
        assert net.tree_all_reduce_time(pl, nbytes) == pytest.approx(tree)
        assert net.all_reduce_time(pl, nbytes) == min(tree, net.ring_all_reduce_time(pl, nbytes))
    # 2 nodes x 4: the ring crosses each node's shared NIC once per step
    pl = net.placement(HW, 8)
    assert net.shift_time(pl, nbytes) == pytest.approx(7e-6 + max(nbytes / 100e9, nbytes / 10e9))
    assert net.shift_time(pl, nbytes, 4) == pytest.approx(7e-6 + 4 * nbytes / 10e9)  # all 4 cross
    assert net.p2p_time(HW, nbytes, same_node=False) == pytest.approx(7e-6 + nbytes / 10e9)
    assert net.p2p_time(HW, nbytes, same_node=True) == pytest.approx(2e-6 + nbytes / 100e9)


def test_all_to_all_costs_what_the_formula_says():
    sent = 48e6
    pl = net.placement(HW, 4)  # one node, per-device links: each device sends sent bytes over its port
    assert net.all_to_all_time(pl, sent) == pytest.approx(2e-6 * (1 + 2) + sent / 100e9)
    pl = net.placement(HW, 8)  # 2 nodes: 4 devices x 4 peers across x piece through one shared NIC
    piece = sent / 7
    assert net.all_to_all_time(pl, sent) == pytest.approx(7e-6 * (1 + 3) + 4 * 4 * piece / 10e9)


SHAPES = [AttnShape(1, 8 * 256, 8, 8, 64, torch.bfloat16, True), AttnShape(2, 8 * 128, 8, 2, 32, torch.float32, False)]


def _formula(name, shape, p, **opt):
    kw = dict(batch=shape.batch, local_seq=shape.seq_len // p, world_size=p, q_heads=shape.q_heads,
              kv_heads=shape.kv_heads, head_dim=shape.head_dim, dtype=shape.dtype)
    f = STRATEGIES[name].bytes_formula()(**kw, **opt)
    return sum(v for (ph, op), v in f["ops"].items() if op != "meta")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("strategy,opts,formula_opts", [
    ("burst", {}, {}), ("burst", {"backward": "kv"}, {"backward": "kv"}), ("ring", {}, {}), ("rsa", {}, {}),
    ("ulysses", {}, {}), ("allgather", {}, {}), ("tp", {}, {}), ("usp", {"ulysses_degree": 2}, {"ulysses_degree": 2})])
def test_simulated_bytes_are_the_library_formula(shape, strategy, opts, formula_opts):
    p = 8
    t = attention_timeline(strategy, shape, HW, p, **opts)
    assert t.forward.bytes_sent + t.backward.bytes_sent == pytest.approx(_formula(strategy, shape, p, **formula_opts))


@pytest.mark.parametrize("shape", SHAPES)
def test_simulated_bytes_distflash_and_double(shape):
    p, n = 8, shape.seq_len // 8
    kw = dict(batch=shape.batch, local_seq=n, world_size=p, q_heads=shape.q_heads, kv_heads=shape.kv_heads,
              head_dim=shape.head_dim, dtype=shape.dtype)
    if shape.causal:
        t = attention_timeline("burst", shape, HW, p, schedule="distflash")
        f = distflash_bytes(rank=p - 1, **kw)
        assert t.forward.bytes_sent + t.backward.bytes_sent == f["forward"] + f["backward"] - (p - 1) * 128
    t = attention_timeline("burst", shape, HW, p, schedule="double")
    f = double_bytes(ranks_per_node=4, backward=t.backward_mode, **kw)
    assert t.forward.bytes_sent + t.backward.bytes_sent == f["forward"] + f["backward"] - (p - 1) * 128


def test_window_replays_the_mask_plan():
    from burstattn.masks.plan import mask_bytes, mask_plan
    from burstattn.masks.spec import AttnMask

    shape = AttnShape(1, 8 * 512, 8, 8, 64, torch.bfloat16, True)
    dense = attention_timeline("burst", shape, HW, 8, layout="contiguous")
    win = attention_timeline("burst", shape, HW, 8, layout="contiguous", window=512)
    assert win.forward.compute < 0.4 * dense.forward.compute  # a window of N/8: about 1/4 of causal's work
    mask = AttnMask(window=(512, 0), block_size=128)
    sent = [mask_bytes(mask_plan(mask, True, 4096, 8, "contiguous", r), batch=1, local_seq=512, q_heads=8,
                       kv_heads=8, head_dim=64, dtype=torch.bfloat16, backward="kv") for r in range(8)]
    busiest = max(f["forward"] + f["backward"] for f in sent)
    assert win.forward.bytes_sent + win.backward.bytes_sent == busiest - 7 * 128
    with pytest.raises(ValueError, match="--window"):
        attention_timeline("ring", shape, HW, 8, window=512)


@pytest.mark.parametrize("layout,causal", [("contiguous", True), ("zigzag", True), ("striped", True), ("zigzag", False)])
@pytest.mark.parametrize("travelling", ["kv", "q"])
def test_ring_symmetry_shortcut_equals_the_full_replay(monkeypatch, layout, causal, travelling):
    full = plans.ring_work.__wrapped__(16, layout, causal, 64, travelling)
    monkeypatch.setattr(plans, "EXACT_P", 4)
    short = plans.ring_work.__wrapped__(16, layout, causal, 64, travelling)
    for a, b in ((full.full, short.full), (full.diag, short.diag), (full.calls, short.calls)):
        assert (a == b).all()


def test_timeline_splits_time_and_sees_imbalance():
    shape = AttnShape(1, 16 * 4096, 32, 32, 128, torch.bfloat16, True)
    hw = preset("h100-nvlink-ib")
    for t in (attention_timeline("burst", shape, hw, 16), attention_timeline("ring", shape, hw, 16)):
        for ps in (t.forward, t.backward):
            assert ps.time == pytest.approx(ps.compute + ps.idle + ps.exposed_comm, rel=1e-6, abs=1e-9)
    zig, contig = attention_timeline("burst", shape, hw, 16), attention_timeline("ring", shape, hw, 16)
    assert zig.forward.idle == pytest.approx(0, abs=1e-9) and contig.forward.idle > 0.3 * contig.forward.compute


def test_memory_model_orders_checkpointing_and_fsdp():
    cfg = SimConfig(model_preset("llama-7b"), 65536, preset("a100-nvlink-ib"), "burst", cp=8)
    mem = {ck: memory_model(dataclasses.replace(cfg, checkpointing=ck)).activations for ck in ("none", "remat", "full")}
    assert mem["none"] > mem["remat"] > mem["full"]
    plain, fsdp = memory_model(cfg), memory_model(dataclasses.replace(cfg, fsdp=True))
    assert plain.optimizer == pytest.approx(12 * model_preset("llama-7b").num_params())
    assert fsdp.optimizer == pytest.approx(plain.optimizer / 8)


def test_planner_never_recommends_a_config_over_memory():
    model = model_preset("llama-7b")
    hw = preset("a100-nvlink-ib").with_overrides(gpu_mem_gib=24)
    rows = plan(model, 65536, 8, hw)
    assert rows[0]["fits"] and rows[0]["peak_memory_bytes"] <= hw.mem_bytes
    assert any(not r["fits"] for r in rows)
    seen_misfit = False
    for r in rows:
        assert r["fits"] == (r["peak_memory_bytes"] <= hw.mem_bytes)
        seen_misfit |= not r["fits"]
        assert not (seen_misfit and r["fits"]), "a config that fits ranked after one that does not"
        if not r["fits"]:
            assert r["why"].startswith("out of memory")
    tiny = preset("a100-nvlink-ib").with_overrides(gpu_mem_gib=1)
    assert not any(r["fits"] for r in plan(model, 65536, 8, tiny))


def _cli_json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_json_keys(capsys, tmp_path):
    out = _cli_json(capsys, ["sim", "--model", "llama-7b", "--seq-len", "32768", "--gpus", "8", "--cluster",
                             "a100-pcie-roce", "--strategy", "burst", "--mode", "train", "--json",
                             "--timeline", str(tmp_path / "t.png")])
    assert {"time_s", "compute_s", "exposed_comm_s", "idle_s", "peak_memory_bytes", "fits"} <= set(out)
    assert out["degrees"] == {"dp": 1, "cp": 8, "tp": 1} and (tmp_path / "t.png").stat().st_size > 1000
    out = _cli_json(capsys, ["sim", "--model", "llama-7b", "--seq-len", "32768", "--gpus", "16", "--cluster",
                             "h100-nvlink-ib", "--strategy", "tp-v3", "--dp", "2", "--mode", "prefill", "--json"])
    assert out["degrees"] == {"dp": 2, "cp": 1, "tp": 8}
    out = _cli_json(capsys, ["sim", "--model", "llama3-8b", "--seq-len", "131072", "--gpus", "8", "--strategy",
                             "burst", "--mode", "decode", "--json", "--inter-gbps", "100"])
    assert out["time_s"] > 0
    out = _cli_json(capsys, ["plan", "--model", "llama-7b", "--seq-len", "65536", "--gpus", "8", "--cluster",
                             "a100-nvlink-ib", "--mode", "prefill", "--json"])
    assert out["ranking"] and {"strategy", "degrees", "time_s", "peak_memory_bytes", "fits", "why"} <= set(
        out["ranking"][0])
    times = [r["time_s"] for r in out["ranking"] if r["fits"]]
    assert times == sorted(times)
    out = _cli_json(capsys, ["plan", "--max-seq-len", "--model", "llama-7b", "--gpus", "8", "--cluster",
                             "a100-nvlink-ib", "--mode", "train", "--json"])
    assert out["max_seq_len"]["burst"] > out["max_seq_len"]["rsa"] > 0


@pytest.mark.parametrize("argv,message", [
    (["--cluster", "a100-nvme"], "unknown cluster preset 'a100-nvme'"),
    (["--cp", "3"], "must multiply to the GPU count"),
    (["--cp", "4", "--tp", "4"], "must multiply to the GPU count"),
    (["--cp", "2", "--tp", "2", "--dp", "1"], "must multiply to the GPU count (--gpus 8)"),
    (["--tp", "3", "--cp", "1", "--dp", "1", "--gpus", "3"], "--tp (3) must divide the model's heads (32)"),
    (["--model", "llama-9b"], "unknown model preset 'llama-9b'"),
])
def test_cli_clear_errors(capsys, argv, message):
    base = ["sim", "--model", "llama-7b", "--seq-len", "32768", "--gpus", "8", "--strategy", "burst"]
    assert main(base + argv) == 2
    assert message in capsys.readouterr().err


def test_a_thousand_devices_and_millions_of_tokens():
    model = model_preset("llama-7b")
    rows = plan(model, 1 << 21, 1024, preset("h100-nvlink-ib"))
    longest = max_seq_len(model, 1024, preset("tpuv4"))
    assert rows[0]["fits"] and longest["burst"]["tokens"] > 1 << 22


@pytest.mark.timed
def test_a_thousand_devices_in_seconds():
    """The planner's speed at 1,024 devices (CPU seconds: the wall clock counts other processes)."""
    model = model_preset("llama-7b")
    start = time.process_time()
    plan(model, 1 << 21, 1024, preset("h100-nvlink-ib"))
    max_seq_len(model, 1024, preset("tpuv4"))
    assert time.process_time() - start < 10


def test_calibrated_spec_file_serves_sim_and_cluster(tmp_path):
    from burstattn.cluster.spec import from_file, resolve
    from burstattn.sim.calibrate import Calibration, cluster_section
    from burstattn.sim.hardware import load, save

    hw = dataclasses.replace(HW, name="calibrated", plain_attn_rates=(1e8, 5e7))
    cal = Calibration(hw, {"attn_fwd": 1e11}, {"bandwidth": 2e9, "latency_s": 1e-4})
    path = str(tmp_path / "spec.json")
    save(hw, path, {"cluster": cluster_section(cal)})
    assert load(path) == hw
    spec = from_file(path)
    assert spec.intra.bandwidth == pytest.approx(2e9) and spec.intra.latency_ms == pytest.approx(0.1)
    assert resolve(path, 2, 2).world_size == 4
    with pytest.raises(ValueError, match="unknown cluster preset"):
        load(str(tmp_path / "missing.json"))

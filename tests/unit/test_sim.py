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
from burstattn.engine.bytes import distflash_bytes, double_bytes, meta_bytes
from burstattn.models.config import preset as model_preset
from burstattn.sim import net, plans
from burstattn.sim.attention import AttnShape, attention_timeline
from burstattn.sim.hardware import PRESETS, ClusterHW, preset
from burstattn.sim.planner import max_seq_len, plan
from burstattn.sim.step import SimConfig, host_capacity, memory_model, simulate
from burstattn.strategies import STRATEGIES

HW = ClusterHW("test", 4, 100e12, 0.5, 0.5, 0.5, 1.0, 1e30, 80e9, intra_bw=100e9, intra_lat=2e-6,
               inter_bw=10e9, inter_lat=7e-6, inter_shared=True)


def test_presets_have_sources_and_cluster_shares_them():
    from bench.cluster.spec import REAL

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
        assert t.forward.bytes_sent + t.backward.bytes_sent == f["forward"] + f["backward"] - meta_bytes(p)
    t = attention_timeline("burst", shape, HW, p, schedule="double")
    f = double_bytes(ranks_per_node=4, backward=t.backward_mode, **kw)
    assert t.forward.bytes_sent + t.backward.bytes_sent == f["forward"] + f["backward"] - meta_bytes(p)


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
    assert win.forward.bytes_sent + win.backward.bytes_sent == busiest - meta_bytes(8)
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
    # with FSDP the optimizer step's temporary is small: the activations decide the peak
    mem = {ck: memory_model(dataclasses.replace(cfg, checkpointing=ck, fsdp=True)).peak for ck in ("none", "remat", "full")}
    assert mem["none"] > mem["remat"] > mem["full"]
    plain, fsdp = memory_model(cfg), memory_model(dataclasses.replace(cfg, fsdp=True))
    n = model_preset("llama-7b").num_params()
    # as burstattn.train.job stores them: without FSDP the weights are cast to bf16 and AdamW's moments
    # follow them (2 x 2 bytes); with FSDP2's mixed precision the moments are float32 (8 bytes) over 8 shards
    assert plain.optimizer == pytest.approx(4 * n)
    assert fsdp.optimizer == pytest.approx(8 * n / 8) and fsdp.params > 4 * n / 8


def test_planner_never_recommends_a_config_over_memory():
    model = model_preset("llama-7b")
    hw = preset("a100-nvlink-ib").with_overrides(gpu_mem_gib=24)
    rows = plan(model, 65536, 8, hw)
    assert rows[0]["fits"] and rows[0]["peak_memory_bytes"] <= hw.mem_bytes
    assert any(not r["fits"] for r in rows)
    seen_misfit = False
    for r in rows:
        host_fits = r["host_memory_bytes"] <= host_capacity(hw, 8)  # offloaded activations or optimizer state
        assert r["fits"] == (r["peak_memory_bytes"] <= hw.mem_bytes and host_fits)
        seen_misfit |= not r["fits"]
        assert not (seen_misfit and r["fits"]), "a config that fits ranked after one that does not"
        if not r["fits"]:
            assert r["why"].startswith("out of memory" if host_fits else "out of host memory")
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
                             "h100-nvlink-ib", "--strategy", "tp-v3", "--dp", "2", "--batch", "2", "--mode", "prefill",
                             "--json"])
    assert out["degrees"] == {"dp": 2, "cp": 1, "tp": 8} and out["tokens_per_step"] == 2 * 32768
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
    (["--gpus", "0"], "--gpus must be a positive int, got 0"),
    (["--ulysses-degree", "2"], "--ulysses-degree is an option of --strategy usp, not 'burst'"),
    (["--strategy", "usp", "--ulysses-degree", "3"], "--ulysses-degree (3) must divide cp (8)"),
    (["--dp", "2", "--batch", "1"], "--batch (1) must be divisible by --dp (2): it is the global batch"),
])
def test_cli_clear_errors(capsys, argv, message):
    base = ["sim", "--model", "llama-7b", "--seq-len", "32768", "--gpus", "8", "--strategy", "burst"]
    assert main(base + argv) == 2
    assert message in capsys.readouterr().err


def test_plan_gpus_zero_names_gpus(capsys):
    assert main(["plan", "--model", "tiny", "--seq-len", "1024", "--gpus", "0"]) == 2
    assert "--gpus must be a positive int, got 0" in capsys.readouterr().err


def test_batch_is_the_global_batch():
    """``batch`` means what `burstattn train --batch` means: sequences per step over all replicas."""
    m, hw = model_preset("llama-7b"), preset("a100-nvlink-ib")
    one = simulate(SimConfig(m, 32768, hw, "burst", cp=8, dp=1, batch=1))
    two = simulate(SimConfig(m, 32768, hw, "burst", cp=8, dp=2, batch=2))  # 16 devices, one sequence per replica
    assert two.compute_s == pytest.approx(one.compute_s, rel=1e-12)
    assert two.peak_memory_bytes == one.peak_memory_bytes
    assert (one.tokens_per_step, two.tokens_per_step) == (32768, 65536)
    assert two.tokens_per_s == pytest.approx(two.tokens_per_step / two.time_s) and two.tokens_per_s > one.tokens_per_s
    with pytest.raises(ValueError, match=r"--batch \(1\) must be divisible by --dp \(2\)"):
        simulate(SimConfig(m, 32768, hw, "burst", cp=8, dp=2, batch=1))


def test_plan_ranks_by_time_per_token_at_one_global_batch():
    """docs/simulation.md's case: at a global batch of 2, ulysses dp=2 x cp=16 (one sequence per
    replica) beats ulysses cp=32 running both sequences; at batch 1 there is no data parallelism."""
    model, hw = model_preset("llama-7b"), preset("a100-pcie-roce")
    rows = [r for r in plan(model, 131072, 32, hw, batch=2) if r["fits"]]
    assert all(r["tokens_per_step"] == 2 * 131072 and r["batch"] == 2 for r in rows)
    per_token = [r["time_s"] / r["tokens_per_step"] for r in rows]
    assert per_token == sorted(per_token)
    assert all(r["tokens_per_s"] == pytest.approx(r["tokens_per_step"] / r["time_s"]) for r in rows)
    where = {(r["strategy"], r["degrees"]["dp"], r["degrees"]["cp"]): i for i, r in enumerate(rows)}
    assert where[("ulysses", 2, 16)] < where[("ulysses", 1, 32)]
    assert {r["degrees"]["dp"] for r in plan(model, 131072, 32, hw, batch=1)} == {1}


@pytest.mark.parametrize("model,seq_len,gpus,batch", [("tiny", 512, 4, 2), ("tiny", 1024, 6, 3), ("tiny", 768, 3, 1),
                                                      ("small", 2048, 8, 4), ("llama-7b", 131072, 32, 2)])
def test_every_printed_train_command_is_accepted_by_burstattn_train(model, seq_len, gpus, batch):
    """Each row's `burstattn train` command parses and passes train's own checks at its --world-size
    (the run itself: tests/dist/test_plan_train.py)."""
    from burstattn.cli import build_parser
    from burstattn.cli.train import config_of
    from burstattn.train.checks import check_config

    rows = plan(model_preset(model), seq_len, gpus, preset("a100-nvlink-ib"), batch=batch, model_name=model)
    assert rows
    parser = build_parser()
    for r in rows:
        argv = r["config"]["train"].split()
        assert argv[:2] == ["burstattn", "train"]
        ns = parser.parse_args(argv[1:])
        assert ns.world_size == gpus and ns.batch == batch
        check_config(config_of(ns), ns.world_size, "cuda")  # raises ValueError if train would refuse it


def test_plan_of_a_tiny_model_prints_units_that_fit(capsys):
    assert main(["plan", "--model", "tiny", "--seq-len", "4096", "--gpus", "4", "--top", "50"]) == 0
    out = capsys.readouterr().out
    assert "0.000s" not in out and "0.0G" not in out
    import re
    rows = [line for line in out.splitlines() if re.match(r"\s+\d+ ", line)]
    assert rows and all(re.search(r" \d[\d.]* (s|ms|us|ns) +[\d.]+[kMG]? +[\d.]+ (B|KiB|MiB|GiB|TiB) ", line)
                        for line in rows), rows


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
    from bench.cluster.spec import from_file, resolve
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


def test_sim_calibrate_shows_progress(capsys, monkeypatch, tmp_path):
    """`sim calibrate` says what it measures while it measures (the measurement itself is replaced:
    its stages are what `measure` reports from the spawned ranks)."""
    import burstattn.sim.calibrate as cal

    def fake_measure(ranks, seconds, rounds, progress=None):
        for i in range(rounds):
            progress(f"kernel rates, round {i + 1}/{rounds}")
        progress("gloo point-to-point")
        rates = {"attn_fwd": 1e11, "attn_bwd": 9e10, "causal_eff": 0.8, "matmul": 2e11, "mem_bw": 4e10,
                 "backend": "cpu_flash", "plain_fwd": 1e8, "plain_bwd": 5e7}
        return rates, {"latency_s": 1e-4, "bandwidth": 3e9}

    monkeypatch.setattr(cal, "measure", fake_measure)
    out = tmp_path / "spec.json"
    assert main(["sim", "calibrate", "--seconds", "0.5", "--rounds", "2", "--out", str(out)]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("burstattn sim calibrate: measuring this machine, about 15 s"), err
    assert err[1:] == ["  kernel rates, round 1/2", "  kernel rates, round 2/2", "  gloo point-to-point"]
    assert out.is_file()
    assert main(["sim", "calibrate", "--rounds", "0"]) == 2
    assert "--rounds at least 1" in capsys.readouterr().err


@pytest.mark.parametrize("ranks", [1, 2, 8])
def test_timeline_legend_clear_of_the_x_label(ranks, tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from burstattn.sim.timeline import plot_timeline, timeline_figure

    events = [(ph, r, kind, 0.1 * i, 0.1 * i + 0.08) for r in range(ranks) for i, (ph, kind) in
              enumerate([("fwd", "compute"), ("fwd", "comm"), ("bwd", "compute"), ("bwd", "comm")])]
    fig = timeline_figure(events, "one layer")
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    label, legend = ax.xaxis.label.get_window_extent(renderer), ax.get_legend().get_window_extent(renderer)
    assert not label.overlaps(legend), (label, legend)
    for tick in ax.get_xticklabels():
        assert not tick.get_window_extent(renderer).overlaps(legend)
    plt.close(fig)
    assert plot_timeline(events, str(tmp_path / "t.png")) and (tmp_path / "t.png").stat().st_size > 1000

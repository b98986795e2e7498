"""The simulator's optimizer offload (``offload_optimizer``) and head chunks (``head_chunks``), pure."""
from __future__ import annotations

import dataclasses

import pytest

from burstattn.models.config import preset as model_preset
from burstattn.sim import memory as mem
from burstattn.sim.hardware import preset
from burstattn.sim.memory import HOST_RESERVE
from burstattn.sim.offload import ADAM_BYTES, HOST_STATE_BYTES, offload_problem
from burstattn.sim.planner import MemoryChoice, max_seq_len, memory_choices
from burstattn.sim.step import SimConfig, host_capacity, memory_model, simulate

L3 = model_preset("llama3-8b")
H100 = preset("h100-nvlink-ib")
BASE = SimConfig(L3, 1 << 20, H100, "burst", cp=8, checkpointing="full", fsdp=True, mlp_chunk=4096, loss_chunk=256)


def test_offload_moves_the_state_to_the_host_and_the_step_to_the_cpu():
    plain, off = memory_model(BASE), memory_model(dataclasses.replace(BASE, offload_optimizer=True))
    n = L3.num_params()
    assert off.optimizer == 0 and off.host_state == pytest.approx(HOST_STATE_BYTES * n / 8)
    assert off.params == pytest.approx(mem.gathered_bytes(L3, tp=1, e=2)) and off.params < plain.params
    assert off.peak < plain.peak and off.fits
    res = simulate(dataclasses.replace(BASE, offload_optimizer=True))
    assert res.breakdown["optimizer_s"] == pytest.approx(ADAM_BYTES * n / 8 / H100.host_adam_bw)
    assert "host_adam_bw" in H100.sources


def test_host_that_cannot_hold_the_state_binds():
    small = H100.with_overrides(host_mem_bytes=10e9)
    m = memory_model(dataclasses.replace(BASE, hw=small, offload_optimizer=True))
    assert not m.fits and m.binding() == "host memory (offloaded optimizer state)"
    assert "--offload-optimizer" in offload_problem(20e9, 10e9)
    # one GPU: the node's whole host; each process keeps its reserve
    assert host_capacity(H100, 1) + HOST_RESERVE == 8 * (host_capacity(H100, 8) + HOST_RESERVE)


def test_bad_options_name_the_flag():
    with pytest.raises(ValueError, match="--offload-optimizer"):
        simulate(dataclasses.replace(BASE, fsdp=False, offload_optimizer=True), memory_only=True)
    with pytest.raises(ValueError, match="--head-chunks"):
        simulate(dataclasses.replace(BASE, head_chunks=3), memory_only=True)


def test_head_chunks_cut_the_call_and_send_smaller_messages():
    u = dataclasses.replace(BASE, strategy="ulysses", seq_len=1 << 21)
    whole, chunked = simulate(u), simulate(dataclasses.replace(u, head_chunks=4))
    # what stays whole: bench/results/simulation.md (on a GPU in bf16 the dry run's call: 7.77 against
    # 10.05 query shards)
    assert chunked.memory.attention < 0.8 * whole.memory.attention
    # ulysses with GQA: 2 kv heads per group over 8 ranks are repeated 4 times (kv_repeats): more bytes
    assert chunked.passes[0].bytes_sent > whole.passes[0].bytes_sent
    a = dataclasses.replace(u, strategy="allgather")
    fwd, fwd4 = simulate(a).passes[0], simulate(dataclasses.replace(a, head_chunks=4)).passes[0]
    assert fwd4.bytes_sent == pytest.approx(fwd.bytes_sent) and fwd4.time >= fwd.time


def test_planner_searches_both_and_meets_the_one_gpu_target():
    choices = memory_choices("train", MemoryChoice())
    assert {c["offload_optimizer"] for c in choices if c["fsdp"]} == {False, True}
    assert not any(c["offload_optimizer"] for c in memory_choices("train", MemoryChoice(offload="none")))
    one = max_seq_len(L3, 1, H100)["burst"]
    assert one["tokens"] >= 500 * 1024 and one["options"]["offload_optimizer"]
    assert one["host_memory_bytes"] <= host_capacity(H100, 1)


def test_train_refusal_names_the_flag():
    from burstattn.models.offload import optimizer_offload_problem

    assert optimizer_offload_problem(10e9, 0.0, 20e9) is None
    msg = optimizer_offload_problem(16e9, 8e9, 20e9)
    assert msg.startswith("--offload-optimizer needs about 14.90 GiB") and "--offload activations" in msg


def test_replicated_kv_heads_are_counted():
    l3 = model_preset("small-l3")  # 1 kv head: at tp 2 both ranks hold the whole wk, wv
    extra = 2 * l3.n_layers * l3.dim * l3.head_dim * 0.5
    assert mem.replicated_kv_params(l3, 2) == extra and mem.replicated_kv_params(L3, 8) == 0
    params = mem.state_bytes(l3, tp=2, shards=1, fsdp=False, train=True, e=4)[0]
    assert params == pytest.approx(4 * (l3.num_params() / 2 + extra))

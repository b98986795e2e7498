"""The planner's longest trainable context (the memory model validated by tests/dist/test_sim_memory.py)
meets the published systems: llama3-8b on 1 H100 above DeepSpeed ALST's 500K tokens (optimizer
offload), on 8 above Untied Ulysses' 5M, on 32 above 16M, llama-7b / llama-13b on 32 A100s at or above
RingAttention's 4M / 2M, each leaving 10% of the device memory free (``sim.memory.HEADROOM``) and counting the
GPU kernel's own buffers and pinned host memory. Without offload, llama3-8b on 32 GPUs misses 6 x 2^20 by 5.8%
(5,923,840 tokens): the layer inputs every layer keeps on the device bind."""
from __future__ import annotations

from burstattn.sim.validation import target_rows, targets_markdown


def test_planner_targets():
    rows = target_rows()
    missed = {(r["model"], r["gpus"], r["offload"]): r for r in rows if r["tokens"] < r["published"]}
    # with the 10% headroom the 1- and 8-GPU answers always kept, llama3-8b on 32 GPUs without offload misses
    # 6 x 2^20 (it met it at 100% of the memory); every other target is met
    assert set(missed) == {("llama3-8b", 32, "none")}, missed
    assert missed[("llama3-8b", 32, "none")]["tokens"] >= 0.94 * 6 * 2**20
    for r in rows:
        assert r["binding"] and r["peak_memory_bytes"] <= 0.9 * 80e9
        if r["offload"] == "none":
            assert r["options"]["offload"] == "none" and r["host_memory_bytes"] == 0
    with_offload = next(r for r in rows if r["model"] == "llama3-8b" and r["offload"] == "searched" and r["gpus"] == 32)
    assert with_offload["tokens"] >= 16 * 2**20 and with_offload["options"]["offload"] != "none"
    assert "llama3-8b" in targets_markdown(rows)

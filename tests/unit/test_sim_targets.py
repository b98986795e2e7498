"""The planner's longest trainable context (the memory model validated by tests/dist/test_sim_memory.py)
meets the published systems: llama3-8b on 1 H100 above DeepSpeed ALST's 500K tokens (optimizer
offload), on 8 above Untied Ulysses' 5M, on 32 above 16M (6M without offload), llama-7b / llama-13b on 32 A100s at or above RingAttention's 4M / 2M."""
from __future__ import annotations

from burstattn.sim.validation import target_rows, targets_markdown


def test_planner_targets():
    rows = target_rows()
    missed = {(r["model"], r["gpus"], r["offload"]) for r in rows if r["tokens"] < r["published"]}
    # every target met (llama3-8b on 32 GPUs without offload missed 6 x 2^20 by 0.7% until the rotary
    # embedding ran in chunks of positions: models.rope, found by the one-GPU dry run at 522K tokens)
    assert missed == set(), missed
    for r in rows:
        assert r["binding"] and r["peak_memory_bytes"] <= 80e9
        if r["offload"] == "none":
            assert r["options"]["offload"] == "none" and r["host_memory_bytes"] == 0
    with_offload = next(r for r in rows if r["model"] == "llama3-8b" and r["offload"] == "searched" and r["gpus"] == 32)
    assert with_offload["tokens"] >= 16 * 2**20 and with_offload["options"]["offload"] != "none"
    assert "llama3-8b" in targets_markdown(rows)

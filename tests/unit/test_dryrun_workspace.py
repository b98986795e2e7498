"""flash-attn's backward workspace in the dry run: added at each kernel backward call, to what is alive then,
with that call's query shape (``train.dryrun.flash_workspace_bytes``), not to a phase's peak wherever it is."""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from burstattn.train.dryrun import flash_workspace_bytes
from burstattn.train.dryrun_tracker import DryRunTracker

B, H, N, D = 1, 4, 256, 64
WS = B * H * N * (D + 1) * 4  # float32 dq_accum [B, N, H, D] and softmax_d [B, H, N]


def _peak(workspace: bool, later: int) -> DryRunTracker:
    """One kernel forward and backward, then a temporary of ``later`` bytes (no kernel runs beside it)."""
    fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    with FakeTensorMode():
        tracker = DryRunTracker(torch.device("cpu"))
        if workspace:
            tracker.workspace_of = flash_workspace_bytes
        with tracker:
            q, k, v, g = (torch.randn(B, H, N, D, dtype=torch.bfloat16) for _ in range(4))
            tracker.start()
            out, lse = fwd(q, k, v, 0.0, True)
            grads = bwd(g, q, k, v, out, lse, 0.0, True)
            del grads, out, lse
            torch.empty(later, dtype=torch.uint8)
    return tracker


def test_workspace_is_added_at_the_kernel_call():
    with_ws, without = _peak(True, 0), _peak(False, 0)
    assert with_ws.workspace_bytes == WS and without.workspace_bytes == 0
    assert with_ws.peak_bytes - without.peak_bytes == WS
    assert with_ws.peak_at[0] == "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"


def test_workspace_is_not_added_to_a_later_peak():
    big = 100 * WS
    with_ws, without = _peak(True, big), _peak(False, big)
    assert with_ws.workspace_bytes == WS
    assert with_ws.peak_bytes == without.peak_bytes and with_ws.peak_at[0] == "aten.empty.memory_format"

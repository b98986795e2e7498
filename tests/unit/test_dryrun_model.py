"""The dry run takes the real run's code path, and the planner's memory model answers to the dry run.

* Fake tensors (``burstattn train --dry-run``) take the fused RMSNorm and rotary autograd nodes that
  plain tensors take: before, a fake tensor failed their ``type(x) is torch.Tensor`` check and ran the
  plain-autograd path (DTensors' path), which keeps float32 copies of every norm's and rotation's rows
  (a bf16 dry run of small-l3 at 8,192 tokens per rank kept 194 MiB where the real step keeps 104).
"""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from burstattn.models.norms import RMSNorm
from burstattn.models.rope import apply_rotary


def _saved(fn) -> list[torch.Tensor]:
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return saved


def test_fake_tensors_take_the_fused_norm_and_rotary():
    with FakeTensorMode():
        norm = RMSNorm(64)
        norm.weight = torch.nn.Parameter(torch.ones(64, dtype=torch.bfloat16))
        x = torch.randn(1, 128, 64, dtype=torch.bfloat16, requires_grad=True)
        kept = _saved(lambda: norm(x))
        # the fused node keeps x, the weight and the float32 rstd [1, 128, 1]: no float32 row copy
        assert sorted(t.numel() for t in kept) == [64, 128, 128 * 64], [(t.dtype, t.shape) for t in kept]
        q = torch.randn(1, 128, 4, 64, dtype=torch.bfloat16, requires_grad=True)
        kept = _saved(lambda: apply_rotary(q, torch.arange(128), 10000.0))
        assert [t.dtype for t in kept] == [torch.int64], [(t.dtype, t.shape) for t in kept]  # the positions only

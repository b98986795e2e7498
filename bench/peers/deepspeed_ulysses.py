"""DeepSpeed-Ulysses: ``deepspeed.sequence.layer.DistributedAttention`` with SDPA as local attention.

Install on a CPU-only machine: ``DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed "torch==<yours>"``
(no compiled ops are needed: the layer is all-to-alls around any local attention module).
``deepspeed.comm`` is initialised over the already-initialised torch.distributed group (gloo).
Inputs ``[B, n, H, D]`` with ``batch_dim_idx=0``, ``scatter_idx=2`` (heads), ``gather_idx=1`` (sequence).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from bench.peers import Contender, PeerUnavailable
from burstattn.layouts.named import local_positions

VARIANTS = ("ulysses",)


class _Sdpa(torch.nn.Module):
    """Local attention on ``[B, S, H/P, D]`` via ``F.scaled_dot_product_attention`` (the CPU flash kernel)."""

    def __init__(self, causal: bool) -> None:
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v, *args, **kwargs):
        # (B, S, h, D) -> (B, h, S, D) -> SDPA -> (B, S, h, D)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=self.causal)
        return out.transpose(1, 2)


def make(variant: str, *, causal: bool, group) -> Contender:
    try:
        import deepspeed.comm as ds_comm
        from deepspeed.sequence.layer import DistributedAttention
    except Exception as e:  # noqa: BLE001 - any import failure is the reason it cannot run
        raise PeerUnavailable(f"deepspeed cannot be imported: {type(e).__name__}: {e}") from e
    if variant not in VARIANTS:
        raise ValueError(f"deepspeed variant must be one of {VARIANTS}, got {variant!r}")
    if not ds_comm.is_initialized():
        ds_comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    layer = DistributedAttention(_Sdpa(causal), group, scatter_idx=2, gather_idx=1)

    def fn(q, k, v):
        return layer(q, k, v, 0)

    return Contender("deepspeed ulysses", fn, lambda s, r, w: local_positions(s, r, w, "contiguous"), "a2a",
                     ulysses_formula)


def ulysses_formula(*, batch, local_seq, world_size, q_heads, kv_heads, head_dim, dtype, **_) -> dict:
    """All-to-alls of q, k, v and the output, (P-1)/P of each local tensor, the same in the backward."""
    e = torch.empty((), dtype=dtype).element_size()
    b = batch * local_seq * head_dim * (2 * q_heads + 2 * kv_heads) * e * (world_size - 1) // world_size
    return {"forward": b, "backward": b}

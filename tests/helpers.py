"""Shared pieces of the tests: deterministic inputs, the case description, error measures.

Everything here is importable in the spawned ranks (module-level, picklable).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from burstattn.layout import local_positions
from burstattn.testing.reference import reference_attention

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}
TOL = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 5e-3, "float64": 1e-10}  # float64 inputs accumulate in float64
HEADS = {"mha": (4, 4), "gqa": (8, 2), "mqa": (4, 1)}


@dataclass(frozen=True)
class Case:
    """One distributed attention call: every rank builds the same full inputs from ``seed``."""

    world: int
    local_seq: int = 16
    batch: int = 1
    heads: str = "mha"  # key of HEADS, or "hq/hkv"
    head_dim: int = 32
    dtype: str = "float32"
    causal: bool = False
    layout: str = "zigzag"
    backward: str = "auto"
    backend: str = "reference"
    softmax_scale: Optional[float] = None
    seed: int = 0

    @property
    def q_heads(self) -> int:
        return HEADS[self.heads][0] if self.heads in HEADS else int(self.heads.split("/")[0])

    @property
    def kv_heads(self) -> int:
        return HEADS[self.heads][1] if self.heads in HEADS else int(self.heads.split("/")[1])

    @property
    def seq_len(self) -> int:
        return self.local_seq * self.world

    def with_(self, **kw) -> "Case":
        return replace(self, **kw)

    def id(self) -> str:
        return (f"w{self.world}-n{self.local_seq}-b{self.batch}-{self.heads}-d{self.head_dim}-{self.dtype}-"
                f"{'causal' if self.causal else 'full'}-{self.layout}-{self.backward}-{self.backend}")


def full_inputs(case: Case) -> tuple[torch.Tensor, ...]:
    """Full-sequence q [B, N, Hq, D], k, v [B, N, Hkv, D] and grad_out [B, N, Hq, D] in the case's dtype."""
    gen = torch.Generator().manual_seed(case.seed)
    b, n, d = case.batch, case.seq_len, case.head_dim
    shapes = [(b, n, case.q_heads, d), (b, n, case.kv_heads, d), (b, n, case.kv_heads, d), (b, n, case.q_heads, d)]
    dtype = DTYPES[case.dtype]
    return tuple(torch.randn(s, generator=gen).to(dtype) for s in shapes)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref||_F / ||ref||_F in float64 (NaN anywhere gives inf)."""
    x64, r64 = x.double(), ref.double()
    if not torch.isfinite(x64).all():
        return float("inf")
    return float((x64 - r64).norm() / r64.norm().clamp_min(1e-300))


def reference_results(case: Case) -> dict[str, torch.Tensor]:
    """The float64 oracle on the full sequence: out, lse, and dq/dk/dv for grad_out."""
    q, k, v, dout = full_inputs(case)
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    out, lse = reference_attention(q64, k64, v64, causal=case.causal, softmax_scale=case.softmax_scale)
    out.backward(dout.double())
    return dict(out=out.detach(), lse=lse.detach(), dq=q64.grad, dk=k64.grad, dv=v64.grad)


def assemble(case: Case, per_rank: list[torch.Tensor], dim: int) -> torch.Tensor:
    """Put every rank's shard back at its global positions along ``dim``."""
    shape = list(per_rank[0].shape)
    shape[dim] = case.seq_len
    full = torch.empty(shape, dtype=per_rank[0].dtype)
    for rank, part in enumerate(per_rank):
        full.index_copy_(dim, local_positions(case.seq_len, rank, case.world, case.layout), part)
    return full

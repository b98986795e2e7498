"""Shared pieces of the tests: deterministic inputs, the case description, error measures and the
ONE tolerance rule.

The rule (:func:`tolerance_failures`): float32 and float64 inputs are compared with the float64
oracle by relative Frobenius error (``EXACT``: 1e-5, 1e-10). 16-bit inputs follow flash-attn's
rule: the largest absolute error against a float32 computation from the same 16-bit inputs (the
truth) must be within ``RULE`` (2x for the output and LSE, 3x for gradients; 2x for the packed
dq/dk/dv of multi-head attention) of the error a plain PyTorch attention computed in the 16-bit
dtype itself makes against that truth (:func:`plain_attention`, flash-attn's ``attention_ref``).
No bound is a constant fitted to a result.

The same rule for every other band in the suite, stated once here:

* a band comes from a stated accuracy of the thing under test (the memory model's 10%, the time
  model's 25%, one element's rounding), never from the last value seen;
* no band is widened by the term it tests: a quantity the model prices is never added to the side of
  the band that checks it;
* where the measurement itself varies (gloo's worker thread frees collective buffers late at times),
  the test measures the repeatable quantity: the smallest peak of a few repeats, or the buffers freed
  explicitly; what remains outside the program (a buffer the program never holds) may lower the floor
  of a band and is named where it does;
* time bounds are one-sided and marked ``timed`` (skipped unless selected on a quiet machine);
* a test whose subject is optional (matplotlib, transformers, TRL) skips without it, naming it.

Everything here is importable in the spawned ranks (module-level, picklable).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from burstattn.layouts.named import local_positions
from burstattn.testing.oracle import exact_attention

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}
EXACT = {"float32": 1e-5, "float64": 1e-10}  # relative error vs float64 (float64 inputs accumulate in float64)
RULE = {"out": 2.0, "lse": 2.0, "dq": 3.0, "dk": 3.0, "dv": 3.0}  # flash-attn's factors
PACKED = 2.0  # flash-attn's factor for the packed dqkv of multi-head attention
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
    out, lse = exact_attention(q64, k64, v64, causal=case.causal, softmax_scale=case.softmax_scale)
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


def plain_attention(q, k, v, *, causal: bool = False, softmax_scale=None, mask=None, upcast: bool = False):
    """flash-attn's ``attention_ref`` (``reorder_ops=True``): plain PyTorch attention computed in the
    inputs' dtype (``upcast=False``, the low-precision reference) or in float32 (``upcast=True``, the
    truth). ``q [B, N, Hq, D]``, ``k, v [B, N, Hkv, D]``, ``mask`` bool ``[N, N]`` (True: visible).
    Returns ``out [B, N, Hq, D]`` and ``lse [B, Hq, N]`` (float32), differentiable."""
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    scores = torch.einsum("bthd,bshd->bhts", q, k * scale)
    visible = mask
    if causal:
        n = q.shape[1]
        tri = torch.ones(n, n, dtype=torch.bool).tril()
        visible = tri if visible is None else visible & tri
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores.float(), -1)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0).to(v.dtype)  # rows that see nothing: 0
    return torch.einsum("bhts,bshd->bthd", probs, v), lse


def _plain_results(q, k, v, dout, upcast: bool, **kw) -> dict:
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out, lse = plain_attention(*leaves, upcast=upcast, **kw)
    out.backward(dout.float() if upcast else dout)
    return dict(out=out.detach(), lse=lse.detach(), dq=leaves[0].grad, dk=leaves[1].grad, dv=leaves[2].grad)


def _max_abs(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest |x - ref| over the entries where ``ref`` is finite (inf: a NaN or inf in ``x`` there)."""
    keep = torch.isfinite(ref)
    d = (x.double() - ref.double())[keep]
    return float("inf") if not torch.isfinite(d).all() else float(d.abs().max()) if d.numel() else 0.0


def rule_bounds(q, k, v, dout, *, causal: bool, softmax_scale=None, mask=None) -> tuple[dict, dict]:
    """flash-attn's rule for 16-bit inputs: ``(truth, bounds)``: the float32 results and, per name,
    ``RULE[name]`` times the plain low-precision reference's largest error against them (plus
    ``"packed"``: ``PACKED`` times its largest gradient error, for multi-head attention)."""
    kw = dict(causal=causal, softmax_scale=softmax_scale, mask=mask)
    truth = _plain_results(q, k, v, dout, True, **kw)
    plain = _plain_results(q, k, v, dout, False, **kw)
    err = {name: _max_abs(plain[name], truth[name]) for name in truth}
    bounds = {name: RULE[name] * e for name, e in err.items()}
    bounds["packed"] = PACKED * max(err["dq"], err["dk"], err["dv"])
    return truth, bounds


def tolerance_failures(case: "Case", got: dict, ref: dict, mask=None) -> dict:
    """``{name: (error, bound)}`` of the results in ``got`` (full-sequence tensors: out, lse, dq, dk,
    dv, any subset) that break the tolerance rule (module docstring); ``ref``: the float64 oracle's
    results (for the exact dtypes); ``mask``: the call's bool ``[N, N]`` visibility beyond ``causal``."""
    if case.dtype in EXACT:
        bad = {}
        for name, x in got.items():
            keep = torch.isfinite(ref[name]) if name == "lse" else slice(None)  # rows that see nothing: -inf
            e = rel_err(x[keep], ref[name][keep])
            if e > EXACT[case.dtype]:
                bad[name] = (e, EXACT[case.dtype])
        return bad
    q, k, v, dout = full_inputs(case)
    truth, bounds = rule_bounds(q, k, v, dout, causal=case.causal, softmax_scale=case.softmax_scale, mask=mask)
    errs = {name: _max_abs(x, truth[name]) for name, x in got.items()}
    bad = {name: (e, bounds[name]) for name, e in errs.items() if e > bounds[name]}
    if case.q_heads == case.kv_heads and {"dq", "dk", "dv"} <= set(errs):
        packed = max(errs["dq"], errs["dk"], errs["dv"])
        if packed > bounds["packed"]:
            bad["packed dqkv"] = (packed, bounds["packed"])
    return bad

"""The README's API snippet, run as written on 2 ranks: every rank shards the same tensors and the
gathered output is exact attention over them (the float64 oracle)."""
from __future__ import annotations

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[2] / "README.md"


def api_snippet() -> str:
    """The first ```python block after the README's ``## API`` heading."""
    text = README.read_text()
    return re.search(r"```python\n(.*?)```", text[text.index("## API"):], re.S).group(1)


def run_snippet(rank: int, world: int, code: str) -> dict:
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 - the project's own README
    return {k: scope[k].detach() for k in ("full_q", "full_kv", "full_out")}


def test_readme_api_snippet_is_exact_on_every_rank(pools):
    from burstattn.testing.oracle import exact_rows

    out = pools.get(2).run(run_snippet, api_snippet())
    for r in out[1:]:
        assert torch.equal(r["full_q"], out[0]["full_q"]), "the ranks sharded different tensors"
        assert torch.equal(r["full_out"], out[0]["full_out"])
    q, (k, v) = out[0]["full_q"], out[0]["full_kv"]
    rows = torch.randperm(q.shape[1], generator=torch.Generator().manual_seed(0))[:256]  # as the demo checks
    want, _ = exact_rows(q[:, rows].double(), k.double(), v.double(), rows, causal=True)
    err = float((out[0]["full_out"][:, rows].double() - want).norm() / want.norm())
    assert err < 1e-5, err

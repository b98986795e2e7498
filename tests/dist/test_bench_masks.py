"""``burstattn bench masks``: the quick run end to end (every point present, correct, bytes equal to
the formula, balance figures of the plans) and the rewrite of its docs section."""
from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from bench.mask_points import packed_documents
from bench.masks import MasksConfig, mask_grid
from bench.masks_report import SECTION, update_section


def test_quick_run(tmp_path):
    from bench.masks import run_masks

    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n\nintro\n\n## Other section\n\nkept text\n")
    cfg = MasksConfig(quick=True, out=str(tmp_path / "out"), docs=str(docs))
    doc = run_masks(cfg, console=Console(file=io.StringIO(), width=200))
    assert json.loads((tmp_path / "out" / "masks.json").read_text())["records"] == doc["records"]
    assert (tmp_path / "out" / "masks.md").read_text().startswith(SECTION)

    plan = mask_grid(cfg.effective())
    want = sorted((p.suite, w, p.name, p.layout) for w, points in plan.items() for p in points)
    assert sorted((r["suite"], r["world_size"], r["name"], r["layout"]) for r in doc["records"]) == want
    for r in doc["records"]:
        what = f"{r['suite']} {r['name']} {r['layout']}"
        assert "median_s" in r, (what, r.get("failed") or r.get("unavailable"))
        assert r["correct"], (what, r["errors"], r["row_errors"])
        assert r["bytes_match"], (what, r["sent_per_rank"], r["formula_per_rank"])
        assert min(r["median_s"].values()) > 0

    by = {(r["suite"], r["name"], r["layout"]): r for r in doc["records"]}
    assert by["masks", "dense causal", "zigzag"]["balance"] == 1.0
    assert by["masks", "dense causal", "contiguous"]["balance"] == pytest.approx(1.75)  # (2P-1)/P at P=4
    window = by["masks", "causal window N/8", "contiguous"]
    assert window["vs_dense"]["work"] < 0.25 and window["vs_dense"]["bytes"]["fwd"] < 0.5
    assert "met" in window
    flash = by["distflash", "causal distflash", "contiguous"]
    assert flash["plan_ratio"] == pytest.approx(0.5) and flash["balance"] == pytest.approx(1.0)
    assert by["distflash", "causal ring zigzag", "zigzag"]["plan_ratio"] == pytest.approx(0.5)

    text = docs.read_text()
    assert text.count(SECTION) == 1 and "kept text" in text and text.index("## Other") < text.index(SECTION)


def test_update_section_keeps_reading(tmp_path):
    path = tmp_path / "b.md"
    path.write_text(f"# B\n\ntop\n\n{SECTION}\n\nold intro\n\n### Reading\n\nhand text\n\n"
                    "### Old table\n\n| x |\n\n## Next\n\nafter\n")
    update_section(path, f"{SECTION}\n\nnew intro\n\n### Table\n\n| y |\n")
    text = path.read_text()
    assert "old intro" not in text and "| x |" not in text and text.count(SECTION) == 1
    order = [text.index(s) for s in ("top", SECTION, "new intro", "### Reading", "hand text", "### Table",
                                     "## Next", "after")]
    assert order == sorted(order)
    update_section(path, f"{SECTION}\n\nthird\n\n### Table\n\n| z |\n")  # idempotent: Reading kept again
    text = path.read_text()
    assert text.count("hand text") == 1 and "| y |" not in text and "| z |" in text


def test_packed_documents():
    cu = packed_documents(32768, 8, 0)
    assert len(cu) == 9 and cu[0] == 0 and cu[-1] == 32768 and all(b > a for a, b in zip(cu, cu[1:]))
    small = packed_documents(1024, 8, 0)  # the same shape at every length (up to rounding)
    assert all(abs(a / 32 - b) <= 1 for a, b in zip(cu, small))
    with pytest.raises(ValueError):
        packed_documents(8, 8, 0)

"""The bench suite driver (bench.driver): points on a pool per world size, one record per
point in order, a failing point as a record (the run goes on), the load per point and per world size,
and the document and its files (JSON, Markdown, a docs file's section)."""
from __future__ import annotations

import io
import json

import torch
import torch.distributed as dist
from rich.console import Console

from bench.driver import Started, document, publish, run_points
from burstattn.meter.progress import ProgressFile


def _point(rank: int, world: int, p: dict, scale: int, progress_path) -> dict:
    ProgressFile(progress_path, rank).start(f"P={world} {p['name']}")
    if p.get("fail"):  # on every rank: no partner is left waiting in a collective
        raise ValueError(f"point {p['name']} refused on rank {rank}")
    x = torch.full((1,), float(rank + 1))
    if world > 1:
        dist.all_reduce(x)
    return {"rank": rank, "sum": float(x) * scale}


def _combine(p: dict, world: int, results: list[dict]) -> dict:
    return {"name": p["name"], "world_size": world, "ranks": [r["rank"] for r in results], "sum": results[0]["sum"]}


def _failed(p: dict, world: int, text: str) -> dict:
    return {"name": p["name"], "world_size": world, "failed": text}


def test_points_records_failures_and_files(pools, tmp_path):
    points = [(2, {"name": "a"}), (1, {"name": "b"}), (2, {"name": "c", "fail": True}), (2, {"name": "d"})]
    console = Console(file=io.StringIO(), width=120)
    started = Started.now()
    records = run_points("driver test", points, _point, _combine, _failed, pools=pools, args=(10,), console=console)
    # world sizes in increasing order, points of one size in their order; a failing point is a record
    assert [(r["world_size"], r["name"]) for r in records] == [(1, "b"), (2, "a"), (2, "c"), (2, "d")]
    assert records[0]["ranks"] == [0] and records[0]["sum"] == 10.0
    assert records[1]["ranks"] == [0, 1] and records[1]["sum"] == 30.0  # the ranks' all-reduce: 1 + 2
    assert "refused on rank" in records[2]["failed"] and "sum" not in records[2]
    assert records[3]["sum"] == 30.0  # the pool went on after the failure
    for r in records:
        assert {"other_load", "other_load_during_spawn"} <= set(r)
        if r["other_load"] is not None:
            assert r["other_load"]["other_cores"] >= 0 and r["other_load"]["wall_s"] >= 0
    doc = document("driver", {"points": len(points)}, started, records=records, extra_field=1)
    assert doc["benchmark"] == "driver" and doc["records"] == records and doc["extra_field"] == 1
    assert {"started", "duration_s", "machine", "code", "torch", "config"} <= set(doc)
    docs = tmp_path / "doc.md"
    docs.write_text("kept\n")
    written = publish(str(tmp_path / "out"), "driver", doc, "# the tables\n", str(docs),
                      lambda path, md: open(path, "a").write(md), console)
    assert [p.name for p in written] == ["driver.json", "driver.md", "doc.md"]
    assert json.loads(written[0].read_text())["records"] == records
    assert written[1].read_text() == "# the tables\n" and docs.read_text() == "kept\n# the tables\n"
    assert "wrote" in console.file.getvalue()

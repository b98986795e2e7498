"""One way for every rank to raise, one checksum: read from the package's source.

* every cross-rank check calls :func:`burstattn.comm.agree.agree`, with the process group as an argument;
  no module outside ``comm/agree.py`` gathers Python objects or all-reduces a flag to decide an error
  (the few gathers and min/max reductions that remain move data or compute values, each named below);
* the only checksum is :func:`burstattn.config.checksum` (``zlib`` is imported nowhere else; ``hashlib``
  only for the plan memo's 128-bit key, where a collision would give a wrong plan, not a missed check).
"""
from __future__ import annotations

import ast
import zlib
from pathlib import Path

import pytest
import torch

from burstattn.comm.agree import checksum as reexported
from burstattn.config import checksum

PACKAGE = Path(__file__).resolve().parents[2] / "burstattn"
AGREE = "comm/agree.py"
# collectives that are not checks: what they move, by file
OBJECT_GATHERS = {"sim/calibrate.py": "the ranks' measured kernel rates", "train/job.py": "the ranks' host names"}
MIN_MAX_REDUCES = {"models/fused_loss.py": "the vocabulary-parallel loss's max logit and argmax",
                   "train/job.py": "the smallest host-memory share of a host's ranks"}
HASHLIB = {"engine/pairs.py": "positions_key: the plan memo's 128-bit key"}


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE).as_posix(), ast.parse(path.read_text(), str(path))


def _name(node: ast.AST) -> str:
    """``all_reduce`` for ``dist.all_reduce`` / ``all_reduce``; ``""`` for anything else."""
    return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""


def _calls(tree: ast.AST, name: str) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and _name(n.func) == name]


def test_object_gathers_and_flag_reductions_only_in_the_one_check():
    found_gathers, found_reduces = set(), set()
    for rel, tree in _modules():
        if _calls(tree, "all_gather_object"):
            found_gathers.add(rel)
        for call in _calls(tree, "all_reduce"):
            op = next((k.value for k in call.keywords if k.arg == "op"), None)
            if op is not None and _name(op) in ("MAX", "MIN"):
                found_reduces.add(rel)
    assert found_gathers - {AGREE} == set(OBJECT_GATHERS), sorted(found_gathers)
    assert found_reduces == set(MIN_MAX_REDUCES), sorted(found_reduces)


def test_every_agree_call_names_its_group():
    callers = set()
    for rel, tree in _modules():
        if rel == AGREE:
            continue
        for call in _calls(tree, "agree"):
            callers.add(rel)
            group = call.args[2] if len(call.args) >= 3 else next((k.value for k in call.keywords
                                                                    if k.arg == "group"), None)
            assert group is not None, f"{rel}:{call.lineno}: agree(...) without a group"
            assert not (isinstance(group, ast.Constant) and group.value is None), f"{rel}:{call.lineno}: group=None"
    # the checks of the call path, recurrences, generation, hf batches / padding / cache, mask_mod failures,
    # dispatch, training flags and host memory, the generate command
    assert {"call/validate.py", "recurrent/passing.py", "infer/generate.py", "hf/batch.py", "hf/attention.py",
            "hf/cache.py", "masks/setup.py", "train/dispatch_step.py", "train/job.py",
            "cli/generate_run.py"} <= callers, sorted(callers)


def test_one_checksum():
    importers = {"zlib": set(), "hashlib": set()}
    for rel, tree in _modules():
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) else [])
            for lib in importers:
                if lib in names:
                    importers[lib].add(rel)
            if isinstance(node, ast.FunctionDef) and rel != "config.py":
                assert not any(w in node.name.lower() for w in ("checksum", "crc", "hash")), f"{rel}: {node.name}"
    assert importers == {"zlib": {"config.py"}, "hashlib": set(HASHLIB)}, importers
    assert reexported is checksum


@pytest.mark.parametrize("dtype", [torch.int64, torch.float64, torch.bfloat16, torch.bool])
def test_checksum_is_crc32_of_the_bytes(dtype):
    x = torch.arange(6).reshape(2, 3).to(dtype)
    raw = x.view(torch.uint8).numpy().tobytes() if dtype != torch.bool else x.numpy().tobytes()
    assert checksum(x) == zlib.crc32(raw)
    assert checksum(x.t()) == checksum(x.t().contiguous())  # row-major values, whatever the strides
    assert checksum("ab") == zlib.crc32(b"ab") and checksum(b"b", checksum(b"a")) == checksum(b"ab")
    assert checksum(torch.tensor(3.0)) == checksum(torch.tensor([3.0]))

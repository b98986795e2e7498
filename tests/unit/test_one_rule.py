"""One home per rule: the ignore index and the accumulators' dtype are defined once (burstattn.config)
and every other module imports them; the errors name the kind of exchange that failed; the library's own
code uses no old spelling of a moved name; reading an old spelling warns naming the new one."""
from __future__ import annotations

import ast
import sys
import warnings
from pathlib import Path

import pytest
import torch

import burstattn
from burstattn.comm.errors import CollectiveError, CommError, RingCommError
from burstattn.config import IGNORE_INDEX, accum_dtype

PACKAGE = Path(burstattn.__file__).parent
SOURCES = sorted(PACKAGE.rglob("*.py"))


def _trees():
    for path in SOURCES:
        yield path, ast.parse(path.read_text(), filename=str(path))


def test_the_ignore_index_is_written_once():
    """-100 appears as a literal in exactly one place of the package: config.IGNORE_INDEX."""
    found = []
    for path, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) \
                    and isinstance(node.operand, ast.Constant) and node.operand.value == 100:
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert found == ["config.py:" + str(_line_of("config.py", "IGNORE_INDEX = -100"))], found
    assert IGNORE_INDEX == -100 == torch.nn.CrossEntropyLoss().ignore_index


def _line_of(name: str, text: str) -> int:
    return next(i for i, line in enumerate((PACKAGE / name).read_text().splitlines(), 1) if line.startswith(text))


def test_the_accumulator_rule_is_written_once():
    """No module but config compares a dtype with float64 to choose float64 or float32."""
    copies = []
    for path, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.IfExp) and "float64" in ast.unparse(node.test) \
                    and {"torch.float64", "torch.float32"} <= {ast.unparse(node.body), ast.unparse(node.orelse)}:
                copies.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert [c.split(":")[0] for c in copies] == ["config.py"], copies


@pytest.mark.parametrize("dtype,want", [(torch.float64, torch.float64), (torch.float32, torch.float32),
                                        (torch.bfloat16, torch.float32), (torch.float16, torch.float32)])
def test_accumulators_are_float32_but_for_float64(dtype, want):
    assert accum_dtype(dtype) is want


def test_errors_name_the_exchange():
    assert issubclass(RingCommError, CommError) and issubclass(CollectiveError, CommError)
    assert issubclass(CommError, RuntimeError)
    assert not issubclass(CollectiveError, RingCommError) and not issubclass(RingCommError, CollectiveError)


def test_collective_failures_raise_collective_errors():
    """The metered collectives, the recurrences' exchanges and the cross-rank check raise CollectiveError."""
    for name in ("comm/collectives.py", "comm/agree.py", "recurrent/comm.py"):
        text = (PACKAGE / name).read_text()
        assert "RingCommError" not in text and "raise CollectiveError(" in text, name


def test_the_library_uses_no_old_spelling():
    """No module of the package imports an old spelling of burstattn.MOVED, or the config alias AttnConfig."""
    old = []
    for path, tree in _trees():
        if path.name == "__init__.py" and path.parent == PACKAGE:
            continue  # the table itself
        package = ".".join(("burstattn",) + path.relative_to(PACKAGE).parent.parts)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
                old += [f"{path.relative_to(PACKAGE)}:{node.lineno} {n}" for n in names if n in burstattn.MOVED]
            elif isinstance(node, ast.Name) and node.id == "AttnConfig":
                old.append(f"{path.relative_to(PACKAGE)}:{node.lineno} AttnConfig")
    assert not old, old


@pytest.mark.parametrize("old,new", [
    ("burstattn.hf.BurstOptions", "burstattn.hf.Registration"),
    ("burstattn.models.IGNORE", "burstattn.config.IGNORE_INDEX"),
    ("burstattn.train.checks.Plan", "burstattn.train.checks.ParallelPlan"),
    ("burstattn.engine.passes", "burstattn.engine.compute"),
    ("burstattn.config.AttnConfig", "burstattn.call.Call"),
])
def test_an_old_spelling_warns_naming_the_new_one(old, new, monkeypatch):
    if old.startswith("burstattn.hf"):
        pytest.importorskip("transformers")
    monkeypatch.delitem(sys.modules, old, raising=False)  # an old module warns when it is imported
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = burstattn._resolve(old)
    assert any(issubclass(w.category, DeprecationWarning) and new in str(w.message) for w in caught), \
        [str(w.message) for w in caught]
    want = burstattn._resolve(new)
    if isinstance(want, type(burstattn)):  # a module: the old path serves the new module's names
        assert got.BlockCalls is want.BlockCalls
    else:
        assert got is want

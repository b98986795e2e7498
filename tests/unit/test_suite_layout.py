"""The shape of the test suite itself, as tests/README.md describes it: rank-side functions live in the
``tests/dist/cases/`` package (no ``*_cases.py`` companions beside the tests), no file name exists in both
unit/ and dist/, and neither tests/ nor burstattn/ cites an issue number a reader cannot look up."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS, DIST, UNIT, CASES = ROOT / "tests", ROOT / "tests" / "dist", ROOT / "tests" / "unit", ROOT / "tests" / "dist" / "cases"
CASES_LINES = 500  # an area grows into a drawer past this: split it (hf_models / hf_hybrid / hf_trainer)

# The word issue followed by a number (any case, plural, with "#", "-" or "_" between) and a bare "#" with 1-4
# digits; a citation of another project's tracker ("owner/repo#N", "owner/repo #N") says where to look, so it stays.
ISSUE = re.compile(r"\bissues?[ _#-]*\d+", re.IGNORECASE)
BARE = re.compile(r"(?<![\w&/.-])#\d{1,4}\b")
EXTERNAL = re.compile(r"[\w.-]+/[\w.-]+ ?#\d+")


def _sources(*roots: Path) -> list[Path]:
    return sorted(p for root in roots for p in root.rglob("*") if p.suffix in (".py", ".md")
                  and "__pycache__" not in p.parts)


def issue_citations(text: str) -> list[str]:
    """The issue numbers ``text`` cites, less citations of another project's tracker."""
    text = EXTERNAL.sub("", text)
    worded = [m.group(0) for m in ISSUE.finditer(text)]
    return worded + [m.group(0) for m in BARE.finditer(ISSUE.sub("", text))]


def test_the_citation_pattern_finds_numbers_and_spares_external_trackers():
    word = "iss" + "ue"  # spelled in two pieces: this file is scanned too
    hash_ = "#"
    text = f"see {word} 39, {word.title()}s {hash_}4, {word}_7 and {hash_}12."
    assert issue_citations(text) == [f"{word} 39", f"{word.title()}s {hash_}4", f"{word}_7", f"{hash_}12"]
    assert issue_citations("pytorch/pytorch#192722, NVIDIA/nccl-tests #149, {x:#010x}, color #3b75af") == []


def test_rank_side_functions_live_in_the_cases_package():
    loose = sorted(p.name for p in DIST.glob("*.py") if p.name.endswith("_cases.py") or p.name == "cases.py")
    assert not loose, f"move {loose} into tests/dist/cases/<area>.py (tests/README.md says which area)"
    assert (CASES / "__init__.py").is_file()
    areas = sorted(p.stem for p in CASES.glob("*.py") if p.name != "__init__.py")
    listed = (CASES / "__init__.py").read_text()
    assert all(f":mod:`.{a}`" in listed for a in areas), f"cases/__init__.py lists every area: {areas}"
    too_long = {a: n for a in areas if (n := len((CASES / f"{a}.py").read_text().splitlines())) > CASES_LINES}
    assert not too_long, f"split these areas in two: {too_long}"


def test_the_cases_modules_define_each_name_once():
    """Merged from several files, a module must not define one name twice (the second silently wins)."""
    for path in sorted(CASES.glob("*.py")):
        seen: dict[str, int] = {}
        for node in ast.parse(path.read_text()).body:
            names = [node.name] if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else [
                t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)]
            for name in names:
                assert name not in seen, f"{path.name}: {name} defined at lines {seen[name]} and {node.lineno}"
                seen[name] = node.lineno


def test_no_test_file_name_is_in_both_unit_and_dist():
    unit = {p.name for p in UNIT.glob("test_*.py")}
    dist = {p.name for p in DIST.glob("test_*.py")}
    assert not unit & dist, f"rename one side for what it checks: {sorted(unit & dist)}"


def test_no_issue_numbers_in_tests_or_the_library():
    found = []
    for path in _sources(TESTS, ROOT / "burstattn"):
        for i, line in enumerate(path.read_text().splitlines(), 1):
            found += [f"{path.relative_to(ROOT)}:{i}: {c}" for c in issue_citations(line)]
    assert not found, "say the reason, not the issue number:\n" + "\n".join(found)


def test_no_test_is_named_for_an_issue():
    named = [f"{p.relative_to(ROOT)}::{n.name}" for p in _sources(TESTS) if p.suffix == ".py"
             for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, (ast.FunctionDef, ast.ClassDef))
             and re.search(r"(issue|ticket|bug|gh)_?\d", n.name, re.IGNORECASE)]
    assert not named, f"name these for the behaviour they check: {named}"

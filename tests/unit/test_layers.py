"""The package's layers import only downward, on the real import graph (lazy imports inside functions
included; imports for type checkers only, under ``if TYPE_CHECKING:``, are not run and are left out).

The order is docs/architecture.md's package map (bottom first). Units of one tier never import each
other; nothing under burstattn/ imports the repository's ``bench`` or an old spelling of
``burstattn.MOVED``."""
from __future__ import annotations

import ast
from pathlib import Path

import burstattn

PACKAGE = Path(burstattn.__file__).parent

TIERS = (
    ("config", "meter", "testing"),  # the vocabulary, and harnesses that import nothing of the library
    ("layouts", "kernels"),
    ("comm",),
    ("engine", "recurrent"),
    ("masks",),
    ("call",),
    ("ops",),
    ("strategies",),
    ("api",),
    ("models", "infer"),
    ("parallel",),
    ("train", "hf"),
    ("sim",),
    ("cli",),
    ("",),  # the package's face: __init__.py
)
TIER = {unit: i for i, units in enumerate(TIERS) for unit in units}


def _module(path: Path) -> str:
    parts = ["burstattn", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _unit(module: str) -> str:
    """``burstattn.call.prepare`` -> ``call``; ``burstattn.ops`` -> ``ops``; ``burstattn`` -> ``""``."""
    return module.split(".")[1] if "." in module else ""


def _type_checking_only(tree: ast.AST) -> set[int]:
    """The ids of the import nodes inside ``if TYPE_CHECKING:`` blocks."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skip


def imports(path: Path) -> list[tuple[str, int]]:
    """``(imported module or name, line)`` of every import run by the file at ``path``, absolute."""
    module = _module(path)
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    tree = ast.parse(path.read_text())
    skip = _type_checking_only(tree)
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module
            out += [(f"{base}.{a.name}", node.lineno) for a in node.names]
    return out


def edges() -> list[tuple[str, str, str]]:
    """``(importing module, imported burstattn module or name, file:line)`` over the package."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for target, line in imports(path):
            out.append((_module(path), target, f"{path.relative_to(PACKAGE.parent)}:{line}"))
    return out


def test_every_unit_has_a_tier():
    units = {_unit(_module(p)) for p in PACKAGE.rglob("*.py")}
    assert units <= set(TIER), f"place these in TIERS (and docs/architecture.md): {sorted(units - set(TIER))}"


def test_layers_import_only_downward():
    upward = []
    for mod, target, where in edges():
        if not target.startswith("burstattn."):
            continue
        a, b = _unit(mod), _unit(target)
        if a != b and TIER[b] >= TIER[a]:
            upward.append(f"{where}: {a} -> {b} ({target})")
    assert not upward, "imports that do not go down:\n" + "\n".join(upward)


FORWARDER = "burstattn.cli.forward"  # `burstattn bench` runs the checkout's bench/ (and says so without one)


def test_the_package_imports_no_measurement_and_no_old_spelling():
    bad = [f"{where}: {target}" for mod, target, where in edges()
           if (target == "bench" or target.startswith("bench.")) and mod != FORWARDER
           or any(target == old or target.startswith(old + ".") for old in burstattn.MOVED)]
    assert not bad, "\n".join(bad)


def test_root_holds_only_the_front_modules():
    assert sorted(p.name for p in PACKAGE.glob("*.py")) == ["__init__.py", "api.py", "config.py", "ops.py"]
    assert not (PACKAGE / "bench").exists() and not (PACKAGE / "cluster").exists()

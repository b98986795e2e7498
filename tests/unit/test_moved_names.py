"""Every moved name keeps working through the one table, ``burstattn.MOVED``: an old spelling inside the
package imports (and reads) the very object of its new home; one outside it (the repository's bench/,
a removed helper) raises naming the spelling that replaces it."""
from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import burstattn

RESOLVING = sorted(old for old, new in burstattn.MOVED.items() if burstattn._resolves(new))
REFUSED = sorted(old for old, new in burstattn.MOVED.items() if not burstattn._resolves(new))


@pytest.mark.parametrize("old", RESOLVING)
def test_old_spelling_resolves_to_the_new_home(old):
    new = burstattn._resolve(burstattn.MOVED[old])
    got = burstattn._resolve(old)  # import_module(OLD), else getattr(import_module(OLD_MODULE), NAME)
    if isinstance(new, type(burstattn)):  # a module: the old path serves the new module's names
        public = [n for n in vars(new) if not n.startswith("_")][:5]
        assert public and all(getattr(got, n) is getattr(new, n) for n in public)
    else:
        assert got is new


@pytest.mark.parametrize("old", REFUSED)
def test_old_spelling_outside_the_package_names_the_new_one(old):
    new = burstattn.MOVED[old].split(" (")[0]
    with pytest.raises(ImportError) as info:
        try:
            got = importlib.import_module(old)
        except ModuleNotFoundError as e:
            if "moved" in str(e):
                raise
            module, name = old.rsplit(".", 1)
            got = getattr(importlib.import_module(module), name)
        got.anything  # an old package kept for the names that resolve below it: every other name refuses
    assert new in str(info.value) and old.split(".")[1] in str(info.value)


def test_bench_submodules_name_their_bench_home_and_meters_stay():
    with pytest.raises(ImportError, match=r"bench\.core .*python -m bench"):
        importlib.import_module("burstattn.bench.core")
    from burstattn.bench.memory import measure_peak
    from burstattn.meter.memory import measure_peak as meter

    assert measure_peak is meter


def test_an_unknown_name_is_a_plain_attribute_error():
    with pytest.raises(AttributeError):
        burstattn.not_a_name  # noqa: B018
    with pytest.raises(ImportError, match="cannot import name"):
        exec("from burstattn.config import not_a_name")


def test_the_finder_is_answered_before_other_finders_of_the_same_names():
    """An editable install's finder would find a stale file at an old path; the table answers first."""
    probe = ("import sys, burstattn\nfrom importlib.machinery import PathFinder\n"
             "i = sys.meta_path.index(PathFinder)\nprint(sys.meta_path[i + 1].__name__)")
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                         cwd=str(Path(burstattn.__file__).parents[1]))
    assert res.stdout.strip() == "_MovedFinder", res.stderr

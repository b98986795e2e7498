"""The README and docs as a newcomer meets them: the Quickstart's two commands are the ones CI runs, the
README stays a five-minute read, and every relative link in it and in docs/ resolves (files and, for
links into a Markdown page, the heading anchor)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def quickstart_commands() -> list[str]:
    text = README.read_text()
    section = text[text.index("## Quickstart"):]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [ln.strip() for ln in block.splitlines() if ln.strip() and not ln.strip().startswith("#")]


def test_quickstart_has_exactly_the_two_commands():
    first, second = quickstart_commands()  # exactly two: unpacking fails otherwise
    assert first.endswith("&& burstattn demo") and first.startswith("pip install")
    ci = (ROOT / ".ci" / "run").read_text()
    # CI runs the second command exactly (quoting of the pin aside)
    assert second.replace('"', "") in ci.replace('"', ""), (second, "is not what .ci/run runs")


def test_readme_is_short():
    assert len(README.read_text().splitlines()) <= 120


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown page (lower case, punctuation dropped, spaces to dashes)."""
    out, inside = set(), False
    for ln in page.read_text().splitlines():
        if ln.startswith("```"):
            inside = not inside
        if not inside and ln.startswith("#"):
            title = ln.lstrip("#").strip().lower()
            out.add(re.sub(r"\s", "-", re.sub(r"[^\w\- ]", "", title)))
    return out


PAGES = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md",
         *sorted((ROOT / "bench" / "results").glob("*.md"))]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_resolves(page):
    missing = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            missing.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            missing.append(target)
    assert not missing, f"{page.name}: links that do not resolve: {missing}"


PATH = re.compile(r"(?<![\w/.-])((?:burstattn|bench|scripts|docs|tests|configs|examples)/[\w/.\-]*\w)")
DOTTED = re.compile(r"(?<![\w.])(burstattn(?:\.\w+)+)")


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_named_path_exists_and_no_old_spelling(page):
    """A repository path a page names exists (or starts some file's name: ``bench/results/cluster`` for
    ``cluster-*.json``; ``NAME`` / ``X`` are placeholders), and no module path is an old spelling of
    ``burstattn.MOVED`` (outside a section "Moved names", which shows them)."""
    import burstattn

    text = re.sub(r"\n## Moved names\n.*?(?=\n## )", "\n", page.read_text(), flags=re.S)
    missing = [p for p in sorted(set(PATH.findall(text)))
               if not re.search(r"\b(NAME|X)\b", p) and not (ROOT / p).exists()
               and not any((ROOT / p).parent.glob((ROOT / p).name + "*"))]
    old = [m for m in sorted(set(DOTTED.findall(text)))
           if any(".".join(m.split(".")[:i]) in burstattn.MOVED for i in range(2, len(m.split(".")) + 1))]
    assert not missing and not old, f"{page.name}: missing paths {missing}, old spellings {old}"

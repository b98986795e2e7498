"""Issue 26 item 7 and 9: the planner says why nothing runs, searches chunk sizes, prices chunks,
takes ``--dtype``, does not offer CPU offload, names the term that grows; ``sim --timeline`` without
matplotlib. Pure functions, no process group; the CLI in-process."""
from __future__ import annotations

import sys

from burstattn.cli import main


def test_timeline_without_matplotlib_prints_the_result_and_one_line(capsys, monkeypatch, tmp_path):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError (the base install)
    png = tmp_path / "timeline.png"
    assert main(["sim", "--model", "tiny", "--seq-len", "4096", "--gpus", "2", "--timeline", str(png)]) == 0
    out, err = capsys.readouterr()
    assert "time " in out and "peak memory" in out and not png.exists(), out
    assert out.count("pip install 'burstattn[bench]'") == 1 and "Traceback" not in out + err, out + err

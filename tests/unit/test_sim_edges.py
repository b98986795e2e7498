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


def test_nothing_runs_says_which_constraint_excluded_each_configuration(capsys):
    assert main(["plan", "--model", "tiny", "--seq-len", "4096", "--gpus", "3", "--cluster", "a100-pcie-roce",
                 "--mode", "train"]) == 0
    out = capsys.readouterr().out
    assert "nothing fits" not in out and "nothing runs on 3 GPUs at --seq-len 4096" in out, out
    assert "1 x --seq-len 4096 does not divide by 2 x cp" in out and "(e.g. dp=1 cp=3 tp=1)" in out, out
    assert "1 x the model's 4 heads do not divide by tp" in out and "1 x --batch 1 does not divide by dp" in out, out


def test_exclusions_are_data_counted_per_constraint():
    from burstattn.models.config import preset as model_preset
    from burstattn.sim.feasible import exclusions

    got = {e.constraint: e.count for e in exclusions(model_preset("tiny"), 6, 8, 4096, 1)}
    # the 9 (cp, tp) of 6 GPUs: tp 3 (cp 1, 2) and tp 6 do not divide 4 heads; cp 3 (tp 1, 2) and cp 6 do not
    # split 4,096 tokens into 2 x cp chunks; the rest have dp > 1 (6, 3, 3) against --batch 1
    assert got == {"tp-heads": 3, "batch-dp": 3, "seq-split": 3}

"""The prepared GPU session runs on a CPU with ``--dry``: every step parses, imports, builds its inputs at
tiny sizes and runs once (the GPU's path through its kernels' plain-PyTorch stand-ins), writing its JSON."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STEPS = ("env", "exact", "world1", "per_rank", "masks", "hybrids", "dryrun", "calibrate")


def test_cuda_session_dry_runs_every_step(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHONPATH=str(ROOT), PATH=os.path.dirname(sys.executable) + ":" +
               os.environ.get("PATH", ""))
    res = subprocess.run(["bash", str(ROOT / "scripts" / "cuda_session.sh"), "--dry"], env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for step in STEPS:
        rep = json.loads((tmp_path / f"{step}.json").read_text())
        assert rep["dry"] and rep["rows"], step
        assert not [r for r in rep["rows"] if "error" in r], (step, rep["rows"])
    exact = json.loads((tmp_path / "exact.json").read_text())["rows"]
    assert all(r["ok"] for r in exact)
    # the dry run models the GPU: the emulated ring's masked pairs take the one-call kernels
    assert {r["policy"] for r in exact if "policy" in r and "none" not in r["case"]} == {"VarlenPair", "FlexPair"}

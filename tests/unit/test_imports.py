"""The core imports with torch alone and does nothing at import time."""
from __future__ import annotations

import json
import subprocess
import sys

import burstattn

PROBE = """
import json, sys
import burstattn
import torch.distributed as dist
heavy = [m for m in ("rich", "matplotlib", "hypothesis", "pytest") if m in sys.modules]
print(json.dumps({"heavy": heavy, "dist": dist.is_available() and dist.is_initialized(),
                  "all": list(burstattn.__all__)}))
"""


def test_core_imports_only_torch():
    res = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120,
                         cwd=str(__import__("pathlib").Path(burstattn.__file__).parents[1]))
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout.strip().splitlines()[-1])
    assert info["heavy"] == [], f"importing burstattn pulled in {info['heavy']}"
    assert info["dist"] is False


def test_public_names_exist():
    for name in burstattn.__all__:
        assert hasattr(burstattn, name), name
    for name in ("burst_attn_func", "BurstAttention", "shard_sequence", "gather_sequence",
                 "sequence_positions", "comm_stats", "trace_steps", "ring_bytes"):
        assert name in burstattn.__all__, name

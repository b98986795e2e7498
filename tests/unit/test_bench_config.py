"""Grid configs are typed files: known keys load (lists become tuples), unknown keys are errors."""
from __future__ import annotations

from pathlib import Path

import pytest

from bench.grid import GridConfig, grid_points

CONFIGS = Path(__file__).resolve().parents[2] / "bench" / "configs"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.name)
def test_shipped_configs_load(path):
    cfg = GridConfig.load(str(path))
    assert cfg.contenders and all(isinstance(s, int) for s in cfg.seq_lens)
    assert grid_points(cfg)


def test_unknown_key_is_an_error(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text("seq_len = [1024]\n")
    with pytest.raises(ValueError, match="unknown key"):
        GridConfig.load(str(f))


def test_max_seq_skips_points(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('contenders = ["burst", "rsa"]\nseq_lens = [512, 1024]\ncausal = [true]\n[max_seq]\nrsa = 512\n')
    names = [(p.contender, p.seq_len) for _, p in grid_points(GridConfig.load(str(f)))]
    assert names == [("burst", 512), ("rsa", 512), ("burst", 1024)]

"""Cluster specs, link parsing and presets (pure; no namespaces needed)."""
from __future__ import annotations

import pytest

from bench.cluster.spec import REAL, ClusterSpec, Link, parse_link, preset, resolve, ring_schedule


@pytest.mark.parametrize("text,bw,lat", [("10mbit", 1.25e6, 0.0), ("2MB", 2e6, 0.0), ("8gbit,5ms", 1e9, 5.0),
                                         ("100kbit,200us", 12500.0, 0.2), ("none", None, 0.0), ("1.5mb/s,1s", 1.5e6, 1000.0)])
def test_parse_link(text, bw, lat):
    link = parse_link(text)
    assert link.bandwidth == pytest.approx(bw) if bw else link.bandwidth is None
    assert link.latency_ms == pytest.approx(lat)


@pytest.mark.parametrize("text", ["", "fast", "10", "10mbit,soon", "0mbit", "1,2,3"])
def test_bad_links(text):
    with pytest.raises(ValueError):
        parse_link(text)


def test_presets_keep_the_real_ratio():
    for name, real in REAL.items():
        spec = preset(name, 2, 2, local_flops=80e9)
        assert spec.inter.bandwidth == pytest.approx(real["inter"] * 80e9 / real["flops"])
        assert real["flops"] / real["inter"] == pytest.approx(80e9 / spec.inter.bandwidth)
        assert spec.world_size == 4 and spec.node_of(3) == 1
    assert preset("a100-pcie-roce", 2, 2, 80e9).inter.bandwidth < 1e7  # a few MB/s next to one CPU core


def test_resolve_and_validation():
    spec = resolve("inter=10mbit;intra=1gbit", 2, 1)
    assert spec.inter == Link(1.25e6) and spec.intra == Link(1.25e8)
    with pytest.raises(ValueError, match="preset"):
        resolve("nvlink", 2, 1)
    with pytest.raises(ValueError, match="nodes"):
        ClusterSpec(0, 1, Link(None), Link(None))
    with pytest.raises(ValueError, match="prefix"):
        ClusterSpec(1, 1, Link(None), Link(None), prefix="Bad-")


def test_topology_choice_follows_the_links():
    assert ring_schedule(preset("h100-nvlink-ib", 2, 4, 80e9)) == "double"   # NVLink >> InfiniBand
    assert ring_schedule(preset("a100-pcie-roce", 2, 4, 80e9)) == "ring"     # PCIe w/o P2P < RoCE
    assert ring_schedule(preset("h100-nvlink-ib", 1, 8, 80e9)) == "ring"     # one node: nothing to nest
    assert ring_schedule(ClusterSpec(2, 2, Link(1e6), Link(None))) == "double"

"""Emulated clusters on one machine: network namespaces as nodes, shaped veth links between them,
real multi-node ``torchrun`` (see :mod:`.netns`, :mod:`.launch`, :mod:`.spec`). Linux, root and
iproute2 only; nothing here is imported by ``import burstattn``."""
from bench.cluster.spec import REAL, ClusterSpec, Link, parse_link, preset, rank_flops, resolve

__all__ = ["ClusterSpec", "Link", "parse_link", "preset", "resolve", "rank_flops", "REAL"]

"""``burstattn cluster up | down | status | run``: the emulated multi-node cluster (network namespaces, tc)."""
from __future__ import annotations

import argparse
import dataclasses
import sys

HELP = "emulated multi-node cluster on this machine (network namespaces, tc)"


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cluster", help=HELP)
    acts = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    up = acts.add_parser("up", help="create the namespaces, links and shaping")
    up.add_argument("--nodes", type=int, default=2)
    up.add_argument("--ranks-per-node", type=int, default=1)
    up.add_argument("--inter", default=None, help="BANDWIDTH[,LATENCY] between nodes, e.g. 10mbit,2ms")
    up.add_argument("--intra", default=None, help="BANDWIDTH[,LATENCY] inside a node, e.g. 100mbit")
    up.add_argument("--preset", default=None, help="a100-pcie-roce or h100-nvlink-ib (calibrated here)")
    up.add_argument("--prefix", default="bt")
    up.add_argument("--cluster-spec", default=None, metavar="FILE",
                    help="links from a spec file written by `burstattn sim calibrate`")
    up.set_defaults(handler=run)
    for name, text in (("down", "remove everything of the cluster (also after a crash)"),
                       ("status", "describe the cluster that is up")):
        a = acts.add_parser(name, help=text)
        a.add_argument("--prefix", default="bt")
        a.set_defaults(handler=run)
    r = acts.add_parser("run", help="torchrun ARGS on every node (e.g. run -- examples/train_step.py)")
    r.add_argument("--prefix", default="bt")
    r.add_argument("--timeout", type=float, default=3600)
    r.add_argument("args", nargs=argparse.REMAINDER)
    r.set_defaults(handler=run)


def run(ns: argparse.Namespace) -> int:
    from bench.cluster import netns
    from bench.cluster.spec import ClusterSpec, parse_link, preset

    try:
        if ns.action == "down":
            removed = netns.down(ns.prefix)
            print(f"removed {len(removed)}: {' '.join(removed) or '(nothing was up)'}")
            return 0
        if ns.action == "status":
            print(netns.load(ns.prefix).describe())
            return 0
        if ns.action == "run":
            from bench.cluster.launch import run_job

            args = ns.args[1:] if ns.args[:1] == ["--"] else ns.args
            results = run_job(netns.load(ns.prefix), args, timeout_s=ns.timeout)
            for res in results:
                print(f"--- node {res.node} (exit {res.returncode}) ---\n{res.output}")
            return max(1 if r.returncode is None else r.returncode for r in results)
        if getattr(ns, "cluster_spec", None):
            from bench.cluster.spec import from_file
            spec = netns.up(from_file(ns.cluster_spec, prefix=ns.prefix), allow_no_latency=True)
            print(f"up: {spec.describe()}; node addresses {[spec.address(i) for i in range(spec.nodes)]}")
            return 0
        if ns.preset is not None:
            if ns.inter or ns.intra:
                raise ValueError("give --preset or --inter/--intra, not both")
            from bench.cluster.spec import rank_flops
            spec = preset(ns.preset, ns.nodes, ns.ranks_per_node, rank_flops(ns.nodes * ns.ranks_per_node))
            spec = netns.up(dataclasses.replace(spec, prefix=ns.prefix), allow_no_latency=True)
        else:
            if not ns.inter or not ns.intra:
                raise ValueError("give --inter BANDWIDTH[,LATENCY] and --intra BANDWIDTH[,LATENCY], or --preset NAME")
            spec = netns.up(ClusterSpec(ns.nodes, ns.ranks_per_node, parse_link(ns.inter), parse_link(ns.intra),
                                        prefix=ns.prefix))
        print(f"up: {spec.describe()}; node addresses {[spec.address(i) for i in range(spec.nodes)]}")
        return 0
    except (ValueError, netns.ClusterError) as e:
        print(f"burstattn cluster: {e}", file=sys.stderr)
        return 2

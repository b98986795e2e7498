"""The block-matrix figures of the docs, drawn from the plans that run (matplotlib).

    python -m bench.scripts.figures [--out docs/img]

* ``layouts.png``: which rank holds each token under contiguous, zigzag and striped, and the causal
  score matrix coloured by the rank that computes each query row (its work per rank in the title);
* ``distflash-schedule.png``: DistFlashAttn's P x P causal block matrix (P = 8), each block coloured
  by the rank that computes it and labelled with its step (the last step's half blocks split by rows);
* ``double-ring.png``: the two-level ring's hops (2 nodes x 4 ranks): the inner ring inside a node,
  the outer ring between the ranks of the same index on every node.

Every cell and arrow comes from :func:`burstattn.layouts.named.local_positions` and
:func:`burstattn.engine.run.build_plan`, so the figures show what the engine executes.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from matplotlib.patches import FancyArrowPatch, Rectangle  # noqa: E402

from burstattn.engine.loop import Nested  # noqa: E402
from burstattn.engine.run import build_plan  # noqa: E402
from burstattn.layouts.named import local_positions  # noqa: E402

COLORS = plt.get_cmap("tab10").colors


def owners(seq_len: int, world: int, layout: str) -> list[int]:
    """``owner[token]``: the rank that holds each global position."""
    out = [0] * seq_len
    for r in range(world):
        for p in local_positions(seq_len, r, world, layout).tolist():
            out[p] = r
    return out


def layouts_figure(path: Path, seq_len: int = 32, world: int = 4) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.9))
    for ax, layout in zip(axes, ("contiguous", "zigzag", "striped")):
        own = owners(seq_len, world, layout)
        work = [0] * world
        for i in range(seq_len):  # query row i computes keys 0..i (causal), on the rank holding i
            work[own[i]] += i + 1
            for j in range(i + 1):
                ax.add_patch(Rectangle((j, i), 1, 1, color=COLORS[own[i]], lw=0))
        for t in range(seq_len):  # the token strip above the matrix: who holds the token
            ax.add_patch(Rectangle((t, -2.2), 1, 1.4, color=COLORS[own[t]], lw=0))
        ax.set_xlim(0, seq_len)
        ax.set_ylim(seq_len, -2.6)
        ax.set_aspect("equal")
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_xlabel("key position")
        ax.set_ylabel("query position")
        ratio = max(work) / (sum(work) / world)
        ax.set_title(f"{layout}\ncausal work per rank {work}\n(max/mean {ratio:.2f})", fontsize=10)
    handles = [Rectangle((0, 0), 1, 1, color=COLORS[r]) for r in range(world)]
    fig.legend(handles, [f"rank {r}" for r in range(world)], loc="lower center", ncol=world, frameon=False)
    fig.suptitle(f"Layouts: the strip is the token -> rank assignment (N = {seq_len}, P = {world}); "
                 "each query row is computed by the rank that holds it", fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def distflash_figure(path: Path, world: int = 8, n: int = 8) -> None:
    """``n`` tokens per rank (the rows of a half step are a fraction of them)."""
    positions = [local_positions(n * world, r, world, "contiguous") for r in range(world)]
    fig, ax = plt.subplots(figsize=(6.6, 6.2))
    for rank in range(world):
        plan = build_plan(rank, world, positions=positions, causal=True, travelling="kv", schedule="distflash")
        for step in plan.steps:
            for pair in step.pairs:
                for op in pair.ops:
                    y0, y1 = pair.q + op.q_start / n, pair.q + op.q_stop / n
                    ax.add_patch(Rectangle((pair.k, y0), 1, y1 - y0, facecolor=COLORS[rank % 10],
                                           edgecolor="white", lw=1.5))
                    ax.text(pair.k + 0.5, (y0 + y1) / 2, f"{step.index}", ha="center", va="center",
                            fontsize=8, color="white")
    ax.set_xlim(0, world)
    ax.set_ylim(world, 0)
    ax.set_aspect("equal")
    ax.set_xticks([k + 0.5 for k in range(world)], [f"K{k}" for k in range(world)])
    ax.set_yticks([q + 0.5 for q in range(world)], [f"Q{q}" for q in range(world)])
    handles = [Rectangle((0, 0), 1, 1, color=COLORS[r % 10]) for r in range(world)]
    ax.legend(handles, [f"rank {r}" for r in range(world)], loc="upper right", fontsize=8)
    ax.set_title(f"DistFlashAttn's causal schedule, P = {world} (contiguous layout)\n"
                 "colour: the rank that computes the block; number: its step", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def double_ring_figure(path: Path, nodes: int = 2, per_node: int = 4) -> None:
    world = nodes * per_node
    positions = [local_positions(2 * world, r, world, "zigzag") for r in range(world)]
    xy = {r: (1.6 * (r % per_node), -2.2 * (r // per_node)) for r in range(world)}
    fig, ax = plt.subplots(figsize=(7.4, 4.6))
    hops: set[tuple[int, int, str]] = set()
    for rank in range(world):
        plan = build_plan(rank, world, positions=positions, causal=True, travelling="kv", schedule="double",
                          ranks_per_node=per_node)
        assert isinstance(plan, Nested)
        node, idx = divmod(rank, per_node)
        for step in plan.outer.steps:  # outer-ring peers are ring positions over the nodes
            for mv in step.fetch:
                if mv.send:
                    hops.add((rank, mv.peer * per_node + idx, "outer"))
        for inner in plan.inner:
            for step in inner.steps:
                for mv in step.fetch:
                    if mv.send:
                        hops.add((rank, node * per_node + mv.peer, "inner"))
    for node in range(nodes):
        x0, y0 = xy[node * per_node]
        ax.add_patch(Rectangle((x0 - 0.6, y0 - 0.6), 1.6 * (per_node - 1) + 1.2, 1.2, fill=False, ls="--",
                               color="grey"))
        ax.text(x0 - 0.55, y0 + 0.62, f"node {node}", fontsize=8, color="grey")
    for src, dst, kind in sorted(hops):
        (xa, ya), (xb, yb) = xy[src], xy[dst]
        rad = 0.35 if kind == "inner" and abs(xa - xb) > 1.7 else (0.25 if kind == "outer" else 0.0)
        ax.add_patch(FancyArrowPatch((xa, ya), (xb, yb), arrowstyle="-|>", mutation_scale=12,
                                     connectionstyle=f"arc3,rad={rad}", shrinkA=14, shrinkB=14,
                                     color="tab:blue" if kind == "inner" else "tab:red",
                                     ls="-" if kind == "inner" else "--", lw=1.4))
    for r, (x, y) in xy.items():
        ax.add_patch(plt.Circle((x, y), 0.28, color=COLORS[r % 10]))
        ax.text(x, y, str(r), ha="center", va="center", color="white", fontsize=9)
    ax.plot([], [], color="tab:blue", label=f"inner ring: {per_node - 1} hops per outer step (fast links)")
    ax.plot([], [], color="tab:red", ls="--", label=f"outer ring: {nodes - 1} hop(s), once per inner round")
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, -0.02), fontsize=8, frameon=False)
    ax.set_xlim(-1, 1.6 * (per_node - 1) + 1)
    ax.set_ylim(-2.2 * (nodes - 1) - 1.7, 1.1)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(f"The two-level ring, {nodes} nodes x {per_node} ranks (schedule='double')", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="docs/img")
    out = Path(ap.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    for name, draw in (("layouts.png", layouts_figure), ("distflash-schedule.png", distflash_figure),
                       ("double-ring.png", double_ring_figure)):
        draw(out / name)
        print(f"wrote {out / name}")


if __name__ == "__main__":
    main()

"""A Gantt chart of one layer's attention timeline: per rank, compute vs communication vs idle over
time (matplotlib, imported only here)."""
from __future__ import annotations

from typing import Sequence


def plot_timeline(events: Sequence[tuple], path: str, title: str = "", max_ranks: int = 8) -> str:
    """Write ``events`` (``(phase, rank, kind, start_s, stop_s)``, kind ``compute`` or ``comm``) as a
    PNG at ``path`` (:func:`timeline_figure`). Returns ``path``."""
    import matplotlib.pyplot as plt

    fig = timeline_figure(events, title, max_ranks)
    fig.savefig(path, dpi=110, bbox_inches="tight")  # "tight": the legend right of the axes is kept
    plt.close(fig)
    return path


def timeline_figure(events: Sequence[tuple], title: str = "", max_ranks: int = 8):
    """The Gantt chart as a matplotlib figure: one row per rank, compute blue, communication orange
    (drawn thinner, below: it overlaps compute when hidden), idle is the white between bars; the
    legend right of the axes, clear of the x label whatever the number of ranks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ranks = sorted({ev[1] for ev in events})[:max_ranks]
    fig, ax = plt.subplots(figsize=(10, 1.5 + 0.45 * len(ranks)))
    end = max((ev[4] for ev in events), default=1.0)
    scale, unit = (1e3, "ms") if end < 1 else (1.0, "s")
    for phase, rank, kind, a, b in events:
        if rank not in ranks or b <= a:
            continue
        y = ranks.index(rank)
        if kind == "compute":
            ax.broken_barh([(a * scale, (b - a) * scale)], (y - 0.05, 0.4),
                           facecolor="#3b75af" if phase == "fwd" else "#6a3d9a")
        else:
            ax.broken_barh([(a * scale, (b - a) * scale)], (y - 0.4, 0.3), facecolor="#ef8636", alpha=0.8)
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel(f"time ({unit})")
    ax.set_title(title)
    ax.legend(handles=[Patch(color="#3b75af", label="compute (forward)"), Patch(color="#6a3d9a",
                       label="compute (backward)"), Patch(color="#ef8636", label="communication in flight")],
              loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    return fig

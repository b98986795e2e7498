"""A progress display for work that runs inside spawned ranks.

Rank 0 appends one line per stage it starts to a small file (:class:`ProgressFile`); the parent
runs the group in a background thread and shows those stages with a ``rich`` progress bar
(:func:`run_with_progress`). A file works across ``spawn`` without shared objects, and costs nothing
when no one watches (``path=None``).
"""
from __future__ import annotations

import os
import tempfile
import threading
from dataclasses import dataclass
from typing import Callable, Optional, TypeVar

T = TypeVar("T")

__all__ = ["ProgressFile", "run_with_progress"]


@dataclass(frozen=True)
class ProgressFile:
    """Rank-side writer. ``path=None`` or a rank other than 0 makes :meth:`start` a no-op."""

    path: Optional[str]
    rank: int = 0

    def start(self, text: str) -> None:
        """Record that the stage described by ``text`` begins (so the previous one finished)."""
        if self.path is None or self.rank != 0:
            return
        with open(self.path, "a") as f:
            f.write(text.replace("\n", " ") + "\n")


def _read_lines(path: str) -> list[str]:
    try:
        with open(path) as f:
            return f.read().splitlines()
    except OSError:
        return []


def run_with_progress(title: str, total_stages: int, work: Callable[[str], T], *,
                      console=None, poll_s: float = 0.2) -> T:
    """Run ``work(progress_path)`` in a thread while showing its stages; return its result.

    ``total_stages`` is the number of :meth:`ProgressFile.start` lines the work writes.
    ``work`` receives the path of the progress file to hand to rank 0 (as ``ProgressFile(path)``).
    Exceptions of ``work`` are re-raised here.
    """
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    fd, path = tempfile.mkstemp(prefix="burstattn-progress-", suffix=".txt")
    os.close(fd)
    outcome: dict[str, object] = {}

    def target() -> None:
        try:
            outcome["result"] = work(path)
        except BaseException as exc:  # noqa: BLE001 - handed back to the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    try:
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                      TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                      console=console, transient=False) as bar:
            task = bar.add_task(f"{title}: starting ranks", total=total_stages)
            thread.start()
            while thread.is_alive():
                thread.join(poll_s)
                lines = _read_lines(path)
                if lines:
                    bar.update(task, completed=min(len(lines) - 1, total_stages),
                               description=f"{title}: {lines[-1]}")
            if "error" not in outcome:
                bar.update(task, completed=total_stages, description=f"{title}: done")
    finally:
        os.unlink(path)
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["result"]  # type: ignore[return-value]

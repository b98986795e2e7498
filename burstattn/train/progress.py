"""The training progress display (rich when installed, plain lines otherwise): step, loss,
accuracy, tokens/s, peak memory per rank, ETA."""
from __future__ import annotations

import sys
import time


def _mib(x: int) -> str:
    return f"{x / 2**20:.0f}"


def describe(rec: dict) -> str:
    acc = "" if rec.get("accuracy") is None else f" key acc {rec['accuracy']:.2f} key loss {rec['answer_loss']:.2f}"
    peaks = "/".join(_mib(p) for p in rec["peak_mem_bytes_per_rank"])
    return (f"loss {rec['loss']:.4f}{acc} lr {rec['lr']:.2e} {rec['tokens_per_s']:.0f} tok/s "
            f"peak MiB/rank {peaks}")


class Progress:
    """Context manager; ``update(record)`` after a step. Disabled: does nothing."""

    def __init__(self, total: int, start: int, enabled: bool = True) -> None:
        self.total, self.start, self.enabled = total, start, enabled
        self._bar = self._task = None
        self._t0 = time.perf_counter()

    def __enter__(self) -> "Progress":
        if not self.enabled or not sys.stdout.isatty():  # plain lines in logs and pipes
            return self
        try:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, \
                TimeRemainingColumn
        except ImportError:
            return self
        self._bar = RichProgress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                                 TextColumn("{task.fields[info]}"))
        self._bar.__enter__()
        self._task = self._bar.add_task("train", total=self.total, completed=self.start, info="")
        return self

    def update(self, rec: dict) -> None:
        if not self.enabled:
            return
        if self._bar is None:
            done = rec["step"] - self.start
            eta = (time.perf_counter() - self._t0) / max(done, 1) * (self.total - rec["step"])
            print(f"step {rec['step']}/{self.total} {describe(rec)} eta {eta:.0f}s", flush=True)
            return
        self._bar.update(self._task, completed=rec["step"], info=describe(rec))

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)

"""Per-step trace of the ring: when each transfer was posted, waited for, and each compute ran.

``with burstattn.trace_steps() as tr: ...`` records host-side timestamps
(``time.perf_counter_ns``) for every ring step of every burstattn call inside the block;
``tr.to_chrome("trace.json")`` writes Chrome-trace / Perfetto JSON (one process per rank,
one thread per phase). On CUDA the timestamps are when work was issued unless the caller
synchronises.
"""
from __future__ import annotations

import contextlib
import contextvars
import json
import time
from typing import Iterator, Optional

_ACTIVE: contextvars.ContextVar[Optional["StepTrace"]] = contextvars.ContextVar(
    "burstattn_step_trace", default=None)


class StepTrace:
    """A list of events ``dict(name, phase, op, step, rank, t0_ns, t1_ns)``.

    ``name`` is ``"post"`` (a transfer was issued; ``t0_ns == t1_ns``), ``"wait"`` (blocked
    on a transfer) or ``"compute"`` (local kernel work of one step).
    """

    def __init__(self) -> None:
        self.events: list[dict] = []

    def record(self, name: str, phase: str, op: str, step: int, rank: int, t0_ns: int,
               t1_ns: Optional[int] = None) -> None:
        """Append one event."""
        self.events.append(dict(name=name, phase=phase, op=op, step=step, rank=rank,
                                t0_ns=t0_ns, t1_ns=t0_ns if t1_ns is None else t1_ns))

    def to_chrome_dict(self) -> dict:
        """The events in Chrome trace format (microseconds)."""
        out = []
        for e in self.events:
            ev = {"name": f"{e['name']}:{e['op']}", "cat": e["phase"], "pid": e["rank"],
                  "tid": e["phase"], "ts": e["t0_ns"] / 1e3, "args": {"step": e["step"]}}
            if e["name"] == "post":
                ev.update(ph="i", s="t")
            else:
                ev.update(ph="X", dur=(e["t1_ns"] - e["t0_ns"]) / 1e3)
            out.append(ev)
        return {"traceEvents": out, "displayTimeUnit": "ms"}

    def to_chrome(self, path: str) -> None:
        """Write :meth:`to_chrome_dict` as JSON to ``path`` (open it in Perfetto or chrome://tracing)."""
        with open(path, "w") as f:
            json.dump(self.to_chrome_dict(), f)


def active_trace() -> Optional[StepTrace]:
    """The trace of the innermost :func:`trace_steps` scope, or ``None``."""
    return _ACTIVE.get()


@contextlib.contextmanager
def trace_steps() -> Iterator[StepTrace]:
    """Record per-step events of burstattn calls inside the block; yields a :class:`StepTrace`."""
    tr = StepTrace()
    token = _ACTIVE.set(tr)
    try:
        yield tr
    finally:
        _ACTIVE.reset(token)


def now_ns() -> int:
    """The clock used for trace events."""
    return time.perf_counter_ns()

"""Byte meter: what this rank sent and received, by phase and operation.

``with burstattn.comm_stats() as stats: ...`` activates a :class:`CommStats` for the code
inside (a ``contextvars`` scope, so threads and nested scopes do not mix). Every
communication of burstattn records into the active meter; the autograd backward records
into the meter active during the backward, or the one active during the forward when the
backward runs in another thread.
"""
from __future__ import annotations

import contextlib
import contextvars
from collections import defaultdict
from typing import Iterator, Optional

_ACTIVE: contextvars.ContextVar[Optional["CommStats"]] = contextvars.ContextVar(
    "burstattn_comm_stats", default=None)


class CommStats:
    """Counters of bytes and messages, keyed by ``(phase, op)``.

    Phases are ``"forward"`` and ``"backward"``; ops name what travels (``"kv"``, ``"q"``,
    ``"dq"``, ``"dkv"``, ``"meta"`` for input validation, ...).
    """

    def __init__(self) -> None:
        self._data: dict[tuple[str, str], dict[str, int]] = defaultdict(
            lambda: {"sent": 0, "recv": 0, "msgs": 0})

    def record(self, phase: str, op: str, sent: int, recv: int) -> None:
        """Add one message's bytes."""
        row = self._data[(phase, op)]
        row["sent"] += int(sent)
        row["recv"] += int(recv)
        row["msgs"] += 1

    def _sum(self, key: str, phase: Optional[str], op: Optional[str]) -> int:
        return sum(row[key] for (p, o), row in self._data.items()
                   if (phase is None or p == phase) and (op is None or o == op))

    def sent(self, phase: Optional[str] = None, op: Optional[str] = None) -> int:
        """Bytes sent, optionally restricted to one phase and/or op."""
        return self._sum("sent", phase, op)

    def received(self, phase: Optional[str] = None, op: Optional[str] = None) -> int:
        """Bytes received, optionally restricted to one phase and/or op."""
        return self._sum("recv", phase, op)

    def sent_by_op(self, key: str = "tuple") -> dict:
        """Bytes sent per ``(phase, op)``: ``{(phase, op): bytes}``, or with ``key="str"``
        ``{"phase/op": bytes}`` (the form JSON reports use)."""
        if key not in ("tuple", "str"):
            raise ValueError(f"key must be 'tuple' or 'str', got {key!r}")
        rows = sorted(self._data.items())
        if key == "str":
            return {f"{phase}/{op}": row["sent"] for (phase, op), row in rows}
        return {(phase, op): row["sent"] for (phase, op), row in rows}

    def as_dict(self) -> dict[str, dict[str, dict[str, int]]]:
        """``{phase: {op: {"sent": bytes, "recv": bytes, "msgs": count}}}``."""
        out: dict[str, dict[str, dict[str, int]]] = {}
        for (phase, op), row in sorted(self._data.items()):
            out.setdefault(phase, {})[op] = dict(row)
        return out

    def reset(self) -> None:
        """Forget everything recorded so far."""
        self._data.clear()


def active_stats() -> Optional[CommStats]:
    """The meter of the innermost :func:`comm_stats` scope, or ``None``."""
    return _ACTIVE.get()


@contextlib.contextmanager
def comm_stats() -> Iterator[CommStats]:
    """Count this rank's communication inside the ``with`` block; yields a :class:`CommStats`."""
    stats = CommStats()
    token = _ACTIVE.set(stats)
    try:
        yield stats
    finally:
        _ACTIVE.reset(token)

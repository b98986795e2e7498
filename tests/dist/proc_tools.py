"""Process helpers of the command-line tests: children of a process, whether a pid still runs,
starting ``burstattn`` in its own session, waiting for a file (Linux ``/proc``)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _stat(pid: int) -> tuple[str, int] | None:
    """``(state, ppid)`` of ``pid`` from ``/proc/PID/stat`` (None: no such process)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # the command name may hold spaces and parentheses
    return fields[0], int(fields[1])


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie nobody reaped counts as dead)."""
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def children(pid: int) -> list[int]:
    """Live direct children of ``pid``."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            st = _stat(int(entry.name))
            if st is not None and st[1] == pid and st[0] not in ("Z", "X"):
                out.append(int(entry.name))
    return sorted(out)


def rank_processes(pid: int) -> list[int]:
    """The local ranks ``pid`` spawned (its multiprocessing children other than the resource tracker)."""
    ranks = []
    for child in children(pid):
        try:
            cmd = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "multiprocessing" in cmd and "resource_tracker" not in cmd:
            ranks.append(child)
    return ranks


def burstattn(args: list[str], out: Path) -> subprocess.Popen:
    """``python -m burstattn.cli ARGS`` in its own session (signals can go to its whole group, as a
    terminal sends Ctrl-C), one torch thread per process; stdout to ``out.stdout``, stderr to
    ``out.stderr`` (files: a pipe nobody reads could block the command)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    with open(f"{out}.stdout", "w") as so, open(f"{out}.stderr", "w") as se:
        return subprocess.Popen([sys.executable, "-m", "burstattn.cli", *args], env=env, start_new_session=True,
                                stdout=so, stderr=se, text=True)


def wait_for(predicate, timeout_s: float, poll_s: float = 0.1) -> bool:
    """Poll ``predicate()`` until it is true (True) or ``timeout_s`` passed (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(poll_s)
    return bool(predicate())

"""Local multi-process groups for tests, demos and benchmarks on one machine.

``run_local`` starts ``world_size`` processes (spawn), runs ``fn(rank, world_size, *args)`` on
each inside an initialised default process group and returns the results in rank order.
``LocalPool`` keeps such a group alive across many calls: starting processes (and importing
torch in each) costs seconds, a case costs milliseconds.

The parent hosts the rendezvous ``TCPStore`` on 127.0.0.1 at an OS-chosen free port (no
pick-a-port race). Values travel as plain pickles (full copies of tensors, no shared-memory
handles), so a rank may exit as soon as it has reported. A rank's exception comes back as a
:class:`RankError` (type names, traceback text) inside a :class:`LocalGroupError`; ``pg_timeout_s``
bounds every collective, so a vanished peer makes its partners raise instead of hang.

No rank outlives its parent: a rank ignores SIGINT (the parent, which gets Ctrl-C too, stops the
ranks) and exits with :data:`PARENT_GONE_EXIT` as soon as the process that started it is gone, even
when that one was killed with SIGKILL (the OOM killer): a daemon thread of each rank waits on
multiprocessing's parent sentinel, a pipe the parent holds open for as long as it lives.
"""
from __future__ import annotations

import datetime
import os
import pickle
import queue as queue_mod
import signal
import threading
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from multiprocessing.connection import wait as wait_ready

__all__ = ["run_local", "LocalPool", "LocalGroupError", "RankError", "PARENT_GONE_EXIT"]

_POLL_S = 0.05
PARENT_GONE_EXIT = 75
"""Exit code of a rank whose parent died (it stops at once, wherever it was)."""


@dataclass(frozen=True)
class RankError:
    """What one rank reported instead of a result (or that it died)."""

    rank: int
    type_names: tuple[str, ...]  # the exception's class and its bases, most derived first
    message: str
    traceback: str

    def __str__(self) -> str:
        return f"rank {self.rank}: {self.traceback or self.message}"


class LocalGroupError(RuntimeError):
    """A call on a local group failed.

    Attributes: ``errors`` (rank -> :class:`RankError`) and ``results`` (rank -> value, for the
    ranks that finished). ``str()`` holds a summary and every failing rank's traceback.
    """

    def __init__(self, summary: str, errors: dict[int, RankError], results: dict[int, object]) -> None:
        self.summary, self.errors, self.results = summary, errors, results
        super().__init__("\n".join([summary] + [str(errors[r]) for r in sorted(errors)]))


def _choose_backend(backend: str | None, world_size: int) -> str:
    if backend is not None:
        return backend
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def _init_group(rank: int, world_size: int, port: int, backend: str, generation: int, pg_timeout_s: float) -> None:
    """Join the default process group number ``generation`` through the parent's store."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"  # for code that reads it; rendezvous uses the store below
    os.environ["MASTER_PORT"] = str(port)
    timeout = datetime.timedelta(seconds=pg_timeout_s)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    prefixed = dist.PrefixStore(f"burstattn-gen{generation}", store)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world_size, timeout=timeout)


def _error_of(rank: int, exc: BaseException) -> RankError:
    names = tuple(c.__name__ for c in type(exc).__mro__ if c is not object)
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return RankError(rank, names, f"{type(exc).__name__}: {exc}", text)


def _call(rank: int, world_size: int, payload: bytes) -> tuple[str, bytes]:
    """Run one pickled (fn, args) on this rank; return ("ok", result) or ("err", RankError)."""
    try:
        fn, args = pickle.loads(payload)
        return "ok", pickle.dumps(fn(rank, world_size, *args))
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        return "err", pickle.dumps(_error_of(rank, exc))


def _reinit(rank, world_size, port, backend, generation, pg_timeout_s) -> tuple[str, bytes]:
    """(Re)join the default group number ``generation``; return ("ok", None) or ("err", RankError)."""
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
        _init_group(rank, world_size, port, backend, generation, pg_timeout_s)
        return "ok", pickle.dumps(None)
    except BaseException as exc:  # noqa: BLE001
        return "err", pickle.dumps(_error_of(rank, exc))


def exit_with_parent() -> bool:
    """In a process started by ``multiprocessing`` (spawn or forkserver): exit with
    :data:`PARENT_GONE_EXIT` as soon as the parent process dies, however it died. A daemon thread
    blocks on the parent sentinel (the read end of a pipe whose write end only the parent holds;
    it reads EOF when the parent is gone), so there is no polling and no Linux-only
    ``PR_SET_PDEATHSIG`` (which fires when the parent's *thread* exits). Returns False when this
    process has no multiprocessing parent (nothing to watch)."""
    parent = mp.parent_process()
    sentinel = getattr(parent, "sentinel", None)
    if sentinel is None:
        return False

    def watch() -> None:
        wait_ready([sentinel])
        os._exit(PARENT_GONE_EXIT)

    threading.Thread(target=watch, name="burstattn-parent-watch", daemon=True).start()
    return True


def _worker(rank, world_size, port, backend, threads, pg_timeout_s, tasks, results) -> None:
    """Process body: watch the parent, set threads, join the group, serve (kind, case_id, payload)
    messages.

    Kinds: "run" (payload: pickled fn and args) and "reinit" (payload: the new generation; a
    fresh default group, so no half-finished collective of a failed case leaks forward).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which stops every rank
    exit_with_parent()
    torch.set_num_threads(threads)
    status, blob = _reinit(rank, world_size, port, backend, 0, pg_timeout_s)
    results.put((-1, rank, status, blob))  # ready (case -1), or why not
    if status != "ok":
        return
    while True:
        message = tasks.get()
        if message is None:
            break
        kind, case_id, payload = message
        if kind == "run":
            status, blob = _call(rank, world_size, payload)
        else:
            status, blob = _reinit(rank, world_size, port, backend, payload, pg_timeout_s)
        results.put((case_id, rank, status, blob))
    if dist.is_initialized():
        dist.destroy_process_group()


class LocalPool:
    """A process group of ``world_size`` local ranks, started once and reused.

    Args:
        world_size: number of ranks (processes).
        backend: process-group backend; None picks "nccl" when there is one CUDA device per
            rank (each rank then uses device ``rank``), else "gloo".
        threads_per_rank: ``torch.set_num_threads`` in each rank.
        timeout_s: limit for starting the group and for each :meth:`run`, in seconds.
        pg_timeout_s: timeout of every collective inside the ranks, in seconds.

    :meth:`run` raises :class:`LocalGroupError` when any rank raised. If every rank reported
    (raised or returned), the pool stays usable: the default process group is re-created before
    the next case. If a rank died or the call exceeded ``timeout_s``, the processes are
    terminated; the next :meth:`run` starts a fresh group.
    """

    def __init__(self, world_size: int, *, backend: str | None = None, threads_per_rank: int = 1,
                 timeout_s: float = 600.0, pg_timeout_s: float = 60.0) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size, self.backend = world_size, _choose_backend(backend, world_size)
        self.threads_per_rank, self.timeout_s, self.pg_timeout_s = threads_per_rank, timeout_s, pg_timeout_s
        self._procs: list = []  # empty: not running
        self._tasks: list = []
        self._results = self._store = None
        self._case_id = self._generation = 0
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=self.pg_timeout_s))
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._generation = 0
        for rank in range(self.world_size):
            proc = ctx.Process(target=_worker, daemon=True, args=(
                rank, self.world_size, self._store.port, self.backend, self.threads_per_rank,
                self.pg_timeout_s, self._tasks[rank], self._results))
            proc.start()
            self._procs.append(proc)
        try:
            self._collect(-1, "starting the group")
        except LocalGroupError:
            self._kill()
            raise

    @property
    def alive(self) -> bool:
        """True while the ranks are running."""
        return bool(self._procs)

    def cpu_seconds(self) -> float:
        """CPU seconds the live ranks used so far (``/proc/<pid>/stat`` utime + stime; 0 where there
        is no ``/proc``): they are not joined children, so the parent's own CPU time misses them."""
        total = 0.0
        for proc in self._procs:
            try:
                with open(f"/proc/{proc.pid}/stat") as f:
                    parts = f.read().rsplit(")", 1)[1].split()
                total += (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")
            except (OSError, ValueError, IndexError):
                pass
        return total

    def close(self) -> None:
        """Stop the ranks (politely, then by force); idempotent."""
        for tasks, proc in zip(self._tasks, self._procs):
            if proc.is_alive():
                tasks.put(None)
        deadline = time.monotonic() + 5.0
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self._kill()

    def _kill(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self._procs:
            proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)
        for q in [*self._tasks, self._results]:
            if q is not None:
                q.cancel_join_thread()
                q.close()
        self._procs, self._tasks, self._results, self._store = [], [], None, None

    def __enter__(self) -> "LocalPool":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None and issubclass(exc_type, (KeyboardInterrupt, SystemExit)):
            self._kill()  # Ctrl-C / SIGTERM: the ranks are busy, asking them politely would only wait
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_procs", None):
            try:
                self._kill()
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass

    def run(self, fn, *args) -> list:
        """Run ``fn(rank, world_size, *args)`` on every rank; return the results in rank order.

        ``fn`` must be a picklable module-level function; ``args`` and the results are pickled.
        Raises :class:`LocalGroupError` (with each failing rank's traceback) on failure.
        """
        if not self._procs:
            self._start()
        try:
            return self._run_once(fn, args)
        except LocalGroupError:
            if self._procs:  # every rank reported: start a clean default group for the next case
                self._generation += 1
                self._case_id += 1
                for tasks in self._tasks:
                    tasks.put(("reinit", self._case_id, self._generation))
                try:
                    self._collect(self._case_id, "re-creating the process group")
                except LocalGroupError:
                    self._kill()  # the next run starts fresh processes
            raise

    def _run_once(self, fn, args) -> list:
        try:
            payload = pickle.dumps((fn, args))
        except Exception as exc:
            raise TypeError(f"fn must be a module-level function and args picklable: {exc}") from exc
        self._case_id += 1
        for tasks in self._tasks:
            tasks.put(("run", self._case_id, payload))
        name = getattr(fn, "__qualname__", repr(fn))
        return self._collect(self._case_id, f"{name} on {self.world_size} ranks")

    def _collect(self, case_id: int, what: str) -> list:
        """Gather one message per rank for ``case_id``; tear down on death or timeout."""
        results: dict[int, object] = {}
        errors: dict[int, RankError] = {}
        deadline = time.monotonic() + self.timeout_s
        dead_since = None
        while len(results) + len(errors) < self.world_size:
            try:
                cid, rank, status, blob = self._results.get(timeout=_POLL_S)
            except queue_mod.Empty:
                cid = None
            if cid == case_id:
                if status == "ok":
                    results[rank] = pickle.loads(blob)
                else:
                    errors[rank] = pickle.loads(blob)
                continue
            now = time.monotonic()
            dead = [r for r, p in enumerate(self._procs)
                    if r not in results and r not in errors and not p.is_alive()]
            if dead and dead_since is None:
                dead_since = now  # give the survivors time to hit their collective timeout
            pending = [r for r in range(self.world_size) if r not in results and r not in errors]
            grace_over = dead_since is not None and (
                now - dead_since > self.pg_timeout_s + 10.0 or len(dead) == len(pending))
            if now > deadline or grace_over:
                for r, p in enumerate(self._procs):
                    if r not in results and r not in errors:
                        code = p.exitcode
                        msg = (f"exited with code {code}" if code is not None
                               else "did not finish (still running when the call was abandoned)")
                        errors[r] = RankError(r, (), msg, "")
                self._kill()
                reason = "timed out" if now > deadline else "lost a rank"
                raise LocalGroupError(f"{what}: {reason}; the group was torn down", errors, results)
        if errors:
            raise LocalGroupError(f"{what}: {len(errors)} rank(s) raised", errors, results)
        return [results[r] for r in range(self.world_size)]


def run_local(fn, world_size: int, *args, backend: str | None = None, threads_per_rank: int = 1,
              timeout_s: float = 600.0, pg_timeout_s: float = 60.0) -> list:
    """Run ``fn(rank, world_size, *args)`` in a fresh local group of ``world_size`` processes.

    Returns the results in rank order. ``fn`` must be a picklable module-level function.
    Raises :class:`LocalGroupError` if any rank raised (with its traceback), died, or the call
    took longer than ``timeout_s``; no process outlives the call. See :class:`LocalPool` for
    ``backend``, ``threads_per_rank`` and ``pg_timeout_s``.
    """
    pool = LocalPool(world_size, backend=backend, threads_per_rank=threads_per_rank,
                     timeout_s=timeout_s, pg_timeout_s=pg_timeout_s)
    try:
        return pool._run_once(fn, args)
    except BaseException:  # Ctrl-C, SIGTERM's SystemExit, a failure: stop the ranks now, not politely
        pool._kill()
        raise
    finally:
        pool.close()

"""The bench suite driver, written once: points, a pool per world size, records, JSON and Markdown.

Every suite (``core``, ``grid``, ``masks``, ``maxlen``, ``infer``, ``train``, ``hf``) is a list of points
and three functions of its own: what a rank measures for a point, how the ranks' results become one
record, and the Markdown of the document. The rest is here:

* :class:`Pools`: one :class:`~burstattn.testing.launch.LocalPool` per (world size, threads per rank),
  started on first use and closed at the end, so a suite's points of one size share one spawn;
* :func:`run_points`: every point on its pool, in order, under a progress bar; a point whose ranks
  raise becomes a ``failed`` record instead of ending the run; per point, what other processes used
  meanwhile (``other_load``, from the machine's and the ranks' CPU time), optionally running a point
  again when the machine was busy; per world size, the load over all its points
  (``other_load_during_spawn``);
* :func:`document`: the JSON document every suite writes (``benchmark``, ``started``, ``duration_s``,
  ``machine``, ``code``, ``torch``, ``config``, ``records`` and the suite's own fields);
* :func:`publish`: ``<out>/<name>.json`` and ``.md``, and the Markdown into a docs file when asked.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, is_dataclass, replace
from pathlib import Path
from typing import Callable, Optional

from burstattn.meter.progress import run_with_progress
from burstattn.meter.timing import code_version, cpu_snapshot, machine_info, other_load

__all__ = ["Pools", "Started", "run_points", "document", "publish"]


class Pools:
    """A :class:`~burstattn.testing.launch.LocalPool` per ``(world_size, threads_per_rank)``, started on
    first use; :meth:`close` (or leaving the ``with`` block) closes them all."""

    def __init__(self, *, timeout_s: float = 7200.0, pg_timeout_s: float = 1800.0) -> None:
        self.timeout_s, self.pg_timeout_s = timeout_s, pg_timeout_s
        self._pools: dict = {}

    def get(self, world_size: int, threads: int = 1):
        key = (world_size, threads)
        if key not in self._pools:
            from burstattn.testing.launch import LocalPool

            self._pools[key] = LocalPool(world_size, backend="gloo", threads_per_rank=threads,
                                         timeout_s=self.timeout_s, pg_timeout_s=self.pg_timeout_s)
        return self._pools[key]

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()

    def __enter__(self) -> "Pools":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass(frozen=True)
class Started:
    """When a run started: the time stamp, the clock, and the code version (read at the start: the
    ranks import the code as it is now)."""

    stamp: str
    t0: float
    code: Optional[dict]

    @staticmethod
    def now() -> "Started":
        return Started(time.strftime("%Y-%m-%dT%H:%M:%S%z"), time.perf_counter(), code_version())


def _load(before, pool_before: float, pool) -> Optional[dict]:
    """What other processes used since ``before``: the pool's ranks are not joined children, so their
    CPU time (:meth:`~burstattn.testing.launch.LocalPool.cpu_seconds`) counts as ours explicitly."""
    after = cpu_snapshot()
    if after is None:
        return None
    return other_load(before, replace(after, own_s=after.own_s + pool.cpu_seconds() - pool_before))


def run_points(title: str, points: list[tuple[int, object]], rank_fn: Callable, combine: Callable,
               failed: Callable, *, pools: Pools, threads: int = 1, args: tuple = (), console=None,
               busy_cores: Optional[float] = None) -> list[dict]:
    """One record per ``(world_size, point)``, in order.

    Each point runs ``rank_fn(rank, world, point, *args, progress_path)`` on every rank of the pool of
    its world size; ``combine(point, world, results)`` makes the record, ``failed(point, world, text)``
    the record of a point whose ranks raised. With ``busy_cores``, a point measured while other
    processes used more cores than that runs once more (``rerun_because_busy``).
    """
    from burstattn.testing.launch import LocalGroupError

    def work(path: str) -> list[dict]:
        records: list[dict] = []
        for world in sorted({w for w, _ in points}):
            pool = pools.get(world, threads)
            spawn, spawn_pool, first = cpu_snapshot(), pool.cpu_seconds(), len(records)
            for _, p in [x for x in points if x[0] == world]:
                for attempt in range(2 if busy_cores is not None else 1):
                    before, pool_before = cpu_snapshot(), pool.cpu_seconds()
                    try:
                        rec = combine(p, world, pool.run(rank_fn, p, *args, path))
                    except LocalGroupError as e:
                        rec = failed(p, world, str(e)[-1500:])
                    rec["other_load"] = load = _load(before, pool_before, pool)
                    if busy_cores is None or not load or load["other_cores"] <= busy_cores or "failed" in rec:
                        break
                    rec["rerun_because_busy"] = True
                records.append(rec)
            load = _load(spawn, spawn_pool, pool)
            for rec in records[first:]:
                rec["other_load_during_spawn"] = load
        return records

    return run_with_progress(title, len(points), work, console=console)


def document(name: str, cfg, started: Started, **fields) -> dict:
    """The JSON document of a run: ``benchmark``, ``started``, ``duration_s``, ``machine``, ``code``,
    ``torch``, ``load_avg_1m_end``, ``config`` (a dataclass or a dict), then the suite's ``fields``
    (``records``, or its suites' results)."""
    import torch

    return {"benchmark": name, "started": started.stamp, "duration_s": round(time.perf_counter() - started.t0, 1),
            "machine": machine_info(), "code": started.code, "torch": torch.__version__,
            "load_avg_1m_end": round(os.getloadavg()[0], 2),
            "config": asdict(cfg) if is_dataclass(cfg) else dict(cfg), **fields}


def publish(out: str, name: str, doc: dict, md: Optional[str] = None, docs: Optional[str] = None,
            update: Optional[Callable] = None, console=None) -> list[Path]:
    """Write ``<out>/<name>.json`` (and ``<out>/<name>.md`` when ``md`` is given), put ``md`` into the file
    ``docs`` with ``update(docs, md)`` when both are given, and show the Markdown and what was written
    (``console``: a rich console; ``None``: nothing shown). Returns the paths written."""
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / f"{name}.json"]
    written[0].write_text(json.dumps(doc, indent=1, default=str))
    if md is not None:
        written.append(out_dir / f"{name}.md")
        written[1].write_text(md)
        if docs and update is not None:
            update(docs, md)
            written.append(Path(docs))
    if console is not None:
        if md is not None:
            from rich.markdown import Markdown

            console.print(Markdown(md))
        console.print("wrote " + ", ".join(map(str, written)))
    return written

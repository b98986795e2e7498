"""A byte meter that wraps ``torch.distributed`` itself, so it counts any library's traffic.

``with dist_meter() as m: ...`` replaces the communication functions of ``torch.distributed``
(and the same names in ``torch.distributed.distributed_c10d``, plus the functional collectives
in ``torch.distributed._functional_collectives`` that PyTorch's context-parallel code uses) by
counting wrappers, and restores the originals on exit. Code that looks the function up on the
module at call time (``dist.all_to_all_single(...)``: burstattn, DeepSpeed, yunchang, PyTorch CP)
is counted; code that bound a function at import (``from torch.distributed import isend``) is not.

Counting convention (the one of :mod:`burstattn.comm.collectives`, so that for burstattn's
strategies this meter agrees with :func:`burstattn.comm_stats`): the bytes THIS rank must put on
the wire, whatever algorithm the backend picks.

* ``isend`` / ``send``: the tensor; ``irecv`` / ``recv``: 0 sent (counted as received).
* ``batch_isend_irecv``: the sum of its sends (the inner ``isend``/``irecv`` calls are not counted again).
* ``all_to_all_single`` / ``all_to_all``: the parts of the input addressed to other ranks
  (``(P-1)/P`` of the input for equal splits).
* ``all_gather`` / ``all_gather_into_tensor`` / ``all_gather_single``: ``(P-1)`` x the input.
* ``reduce_scatter`` / ``reduce_scatter_tensor`` / ``reduce_scatter_single``: ``(P-1)/P`` x the input.
* ``all_reduce``: ``2 (P-1)/P`` x the tensor (reduce-scatter + all-gather, the bandwidth-optimal lower bound).
* ``broadcast``: the source sends ``(P-1)`` x the tensor, the others 0.

Wrappers nest-guard: a counted call made from inside another counted call (``permute_tensor`` ->
``all_to_all_single``; ``batch_isend_irecv`` -> ``isend``) is not counted twice. The meter is
process-wide while active (patching module attributes is), so use it from one thread.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections import defaultdict
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

__all__ = ["DistMeter", "dist_meter"]


class DistMeter:
    """Bytes sent/received and call counts per wrapped function name."""

    def __init__(self) -> None:
        self.ops: dict[str, dict[str, int]] = defaultdict(lambda: {"sent": 0, "recv": 0, "calls": 0})

    def record(self, name: str, sent: int, recv: int) -> None:
        row = self.ops[name]
        row["sent"] += int(sent)
        row["recv"] += int(recv)
        row["calls"] += 1

    @property
    def sent(self) -> int:
        """Total bytes this rank sent."""
        return sum(r["sent"] for r in self.ops.values())

    @property
    def received(self) -> int:
        return sum(r["recv"] for r in self.ops.values())

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {k: dict(v) for k, v in sorted(self.ops.items())}


def _nbytes(t) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


def _size_rank(group) -> tuple[int, int]:
    """(P, this rank's index) of a ProcessGroup / None / rank list / DeviceMesh."""
    if group is None or isinstance(group, dist.ProcessGroup):
        g = group if group is not None else dist.group.WORLD
        return dist.get_world_size(g), dist.get_rank(g)
    from torch.distributed import _functional_collectives as ft_c

    _, ranks, size = ft_c._expand_group(group)
    me = dist.get_rank()
    return size, (ranks.index(me) if me in ranks else 0)


def _a2a_single_sent(args: dict, p: int, r: int) -> int:
    x = args.get("input", args.get("self"))
    splits = args.get("input_split_sizes")
    if not splits:
        return _nbytes(x) * (p - 1) // p
    row = _nbytes(x) // max(1, x.shape[0])
    return sum(s for j, s in enumerate(splits) if j != r) * row


def _sent(name: str, args: dict) -> tuple[int, int]:
    """(sent, received) bytes of one call, from its bound arguments."""
    if name in ("isend", "send"):
        return _nbytes(args["tensor"]), 0
    if name in ("irecv", "recv"):
        return 0, _nbytes(args["tensor"])
    if name == "batch_isend_irecv":
        ops = args["p2p_op_list"]
        sent = sum(_nbytes(o.tensor) for o in ops if o.op.__name__ == "isend")
        return sent, sum(_nbytes(o.tensor) for o in ops if o.op.__name__ == "irecv")
    p, r = _size_rank(args.get("group"))
    if name == "all_to_all_single":
        s = _a2a_single_sent(args, p, r)
        return s, s
    if name == "all_to_all":
        ins = args["input_tensor_list"]
        s = sum(_nbytes(t) for j, t in enumerate(ins) if j != r)
        return s, s
    if name in ("all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_tensor"):
        x = args.get("tensor", args.get("input_tensor", args.get("self", args.get("input"))))
        s = _nbytes(x) * (p - 1)
        return s, s
    if name in ("reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single"):
        x = args.get("input", args.get("input_list", args.get("self")))
        s = _nbytes(x) * (p - 1) // p
        return s, s
    if name == "all_reduce":
        x = args.get("tensor", args.get("self"))
        s = 2 * _nbytes(x) * (p - 1) // p
        return s, s
    if name == "broadcast":
        x = args.get("tensor", args.get("self"))
        src = args.get("src", 0)
        me = dist.get_rank()
        return (_nbytes(x) * (p - 1), 0) if src == me else (0, _nbytes(x))
    return 0, 0


_DIST_NAMES = ("isend", "irecv", "send", "recv", "batch_isend_irecv", "all_to_all_single", "all_to_all",
               "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
               "reduce_scatter_tensor", "reduce_scatter_single", "all_reduce", "broadcast")
_FT_NAMES = ("all_to_all_single", "all_gather_single", "all_gather_tensor", "reduce_scatter_tensor",
             "all_reduce", "broadcast")


def _wrap(orig: Callable, name: str, meter: DistMeter, guard: threading.local) -> Callable:
    sig = inspect.signature(orig)

    @functools.wraps(orig)
    def wrapper(*args, **kwargs):
        if getattr(guard, "depth", 0):
            return orig(*args, **kwargs)
        try:
            bound = sig.bind(*args, **kwargs).arguments
            sent, recv = _sent(name, bound)
        except Exception:  # noqa: BLE001 - never break the call because of the meter
            sent, recv = 0, 0
            meter.record(f"{name}:uncounted", 0, 0)
        guard.depth = 1
        try:
            out = orig(*args, **kwargs)
        finally:
            guard.depth = 0
        meter.record(name, sent, recv)
        return out

    return wrapper


@contextlib.contextmanager
def dist_meter(meter: Optional[DistMeter] = None) -> Iterator[DistMeter]:
    """Count every wrapped ``torch.distributed`` call inside the block; yields a :class:`DistMeter`."""
    from torch.distributed import _functional_collectives as ft_c
    from torch.distributed import distributed_c10d as c10d

    meter = meter if meter is not None else DistMeter()
    guard = threading.local()
    saved: list[tuple[object, str, Callable]] = []
    wrappers: dict[str, Callable] = {}
    for name in _DIST_NAMES:
        orig = getattr(c10d, name, None) or getattr(dist, name, None)
        if orig is None:
            continue
        wrappers[name] = _wrap(orig, name, meter, guard)
        for mod in (dist, c10d):  # the same wrapper in both, so `op.op is isend` checks still hold
            if hasattr(mod, name):
                saved.append((mod, name, getattr(mod, name)))
                setattr(mod, name, wrappers[name])
    for name in _FT_NAMES:
        if hasattr(ft_c, name):
            saved.append((ft_c, name, getattr(ft_c, name)))
            setattr(ft_c, name, _wrap(getattr(ft_c, name), name, meter, guard))
    try:
        yield meter
    finally:
        for mod, name, orig in reversed(saved):
            setattr(mod, name, orig)

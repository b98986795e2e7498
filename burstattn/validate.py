"""Input checks that fail on EVERY rank, never on one rank while the others hang.

Each rank checks its own arguments locally, then all ranks exchange a 16-integer signature
(error code, shapes, dtype, options) with one all-gather before any ring traffic. If any rank
found a problem, or the ranks disagree (e.g. different local sequence lengths), every rank
raises: the rank at fault with its own detailed message, the others naming that rank and
the problem.
"""
from __future__ import annotations

import math
import numbers
import zlib
from typing import Optional

import torch
import torch.distributed as dist

from .comm.ring import RingCommError
from .comm.stats import active_stats
from .config import BACKENDS, BACKWARDS, LAYOUTS, SCHEDULES, AttnConfig
from .formulas import META_INTS
from .kernels import resolve_backend

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_KINDS = {1: TypeError, 2: ValueError}


def scale_value(softmax_scale):
    """``softmax_scale`` as a Python float when it is a real number (a Python or NumPy float or int,
    or a 0-d real tensor), ``None`` for ``None``; anything else (a bool, a string, a 1-d tensor) is
    returned unchanged for :func:`local_problem` to report."""
    s = softmax_scale
    if s is None or isinstance(s, bool):
        return s
    if isinstance(s, torch.Tensor):
        if s.dim() == 0 and not s.dtype.is_complex and s.dtype != torch.bool:
            return float(s)  # a 0-d tensor: one value, read once here (outside any traced region)
        return s
    return float(s) if isinstance(s, numbers.Real) else s


def option_problem(cfg: AttnConfig) -> Optional[tuple[type, str]]:
    """Type problems of the scalar options (``causal`` a bool, ``softmax_scale`` a positive real)."""
    if not isinstance(cfg.causal, bool):
        return TypeError, f"causal must be a bool (True or False), got {type(cfg.causal).__name__} {cfg.causal!r}"
    s = cfg.softmax_scale
    if s is not None and (isinstance(s, bool) or not isinstance(s, (int, float))):
        return TypeError, (f"softmax_scale must be None or a real number (float, int, NumPy float, 0-d tensor), "
                           f"got {type(s).__name__} {s!r}")
    if s is not None and (not math.isfinite(s) or s <= 0):
        return ValueError, f"softmax_scale must be None or a positive finite number, got {s!r}"
    return None


def local_problem(q, k, v, cfg: AttnConfig) -> Optional[tuple[type, str]]:
    """The first problem with this rank's arguments as ``(exception class, message)``, or None."""
    problem = option_problem(cfg)
    if problem:
        return problem
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            return TypeError, f"{name} must be a torch.Tensor, got {type(x).__name__}"
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 4:
            return ValueError, (f"{name} must be 4-D [batch, local_seq, heads, head_dim], "
                                f"got shape {tuple(x.shape)}")
    if k.shape != v.shape:
        return ValueError, f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}"
    names = ("batch", "local_seq", "heads", "head_dim")
    for i in (0, 1, 3):
        if q.shape[i] != k.shape[i]:
            return ValueError, (f"q and k must have the same {names[i]} (dim {i}), got "
                                f"q {tuple(q.shape)} and k {tuple(k.shape)}")
    if not q.dtype == k.dtype == v.dtype:
        return TypeError, f"q, k, v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
    if q.dtype not in DTYPES:
        return TypeError, f"q dtype must be one of {[str(d) for d in DTYPES]}, got {q.dtype}"
    if not q.device == k.device == v.device:
        return ValueError, f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}"
    if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        return ValueError, (f"q_heads must be a multiple of kv_heads (GQA/MQA), got q_heads="
                            f"{q.shape[2]}, kv_heads={k.shape[2]}")
    if q.shape[1] == 0 or q.shape[3] == 0 or q.shape[0] == 0:
        return ValueError, f"q must have non-empty batch, local_seq and head_dim, got {tuple(q.shape)}"
    if not isinstance(cfg.layout, str):
        if not hasattr(cfg.layout, "positions_of"):
            return ValueError, f"layout must be one of {LAYOUTS} or a Partition, got {type(cfg.layout).__name__}"
        if cfg.layout.local_len != q.shape[1]:
            return ValueError, (f"layout: the partition gives every rank {cfg.layout.local_len} tokens, but "
                                f"local_seq (q.shape[1]) is {q.shape[1]}")
    elif cfg.layout not in LAYOUTS:
        return ValueError, f"layout must be one of {LAYOUTS} or a Partition, got {cfg.layout!r}"
    for arg, value, allowed in (("backend", cfg.backend, BACKENDS),
                                ("backward", cfg.backward, BACKWARDS), ("schedule", cfg.schedule, SCHEDULES)):
        if value not in allowed:
            return ValueError, f"{arg} must be one of {allowed}, got {value!r}"
    if cfg.schedule == "distflash" and (not cfg.causal or cfg.layout != "contiguous" or cfg.backward != "auto"):
        return ValueError, (f"schedule 'distflash' balances causal attention over the contiguous layout and "
                            f"has its own backward: it needs causal=True, layout='contiguous', backward='auto'; "
                            f"got causal={cfg.causal}, layout={cfg.layout!r}, backward={cfg.backward!r}")
    if cfg.schedule == "double" and (cfg.topology is None or not hasattr(cfg.topology, "ranks_per_node")):
        return ValueError, ("schedule 'double' needs topology=burstattn.two_level_groups(ranks_per_node) "
                            "(built once, on every rank)")
    if cfg.schedule != "double" and cfg.topology is not None:
        return ValueError, f"topology is only used by schedule='double', got schedule={cfg.schedule!r}"
    if cfg.schedule == "double" and cfg.sparse:
        return ValueError, "schedule 'double' runs dense attention; masks and partitions use their own schedule"
    if cfg.schedule == "distflash" and cfg.sparse:
        return ValueError, ("schedule 'distflash' is for dense causal attention over the contiguous layout; masks "
                            "and partitions run their own sparse schedule (schedule='ring')")
    if cfg.layout == "zigzag" and q.shape[1] % 2:
        return ValueError, (f"layout 'zigzag' needs an even local_seq (two chunks per rank), got "
                            f"local_seq={q.shape[1]}; pad the sequence to a multiple of 2 * world_size")
    try:
        resolve_backend(cfg.backend, q.device, q.dtype)
    except ValueError as e:
        return ValueError, str(e)
    return None


def _signature(q, k, cfg: AttnConfig, problem, fn: str, world_size: int) -> list[int]:
    code = 0 if problem is None else (1 if problem[0] is TypeError else 2)
    if code:
        return [code] + [0] * (META_INTS - 1)
    options = (LAYOUTS.index(cfg.layout) if isinstance(cfg.layout, str) else len(LAYOUTS), int(cfg.causal),
               BACKENDS.index(cfg.backend),
               BACKWARDS.index(cfg.backward))
    scale_bits = int(torch.tensor(cfg.softmax_scale or 0.0, dtype=torch.float64).view(torch.int64))
    sig = [0, q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.shape[3],
           DTYPES.index(q.dtype), *options, scale_bits, SCHEDULES.index(cfg.schedule),
           zlib.crc32(fn.encode()), cfg.mask_key(q.shape[1] * world_size)]
    return sig + [0] * (META_INTS - len(sig))


_FIELDS = ("", "batch", "local_seq (q.shape[1])", "q_heads", "kv_heads", "head_dim", "dtype",
           "layout", "causal", "backend", "backward", "softmax_scale", "schedule",
           "function (burst_attn_func or the attention strategy)",
           "mask (window / cu_seqlens / document_ids / mask_mod) or partition layout")


def check_inputs(q, k, v, cfg: AttnConfig, group: Optional[dist.ProcessGroup], world_size: int,
                 fn: str = "burst_attn_func", extra: Optional[tuple[type, str]] = None) -> None:
    """Raise on every rank if any rank's inputs are invalid or the ranks disagree.

    ``extra``: a problem the caller found in this rank's other arguments, as
    ``(TypeError or ValueError, message)``; it is shared like the tensor checks (after them),
    so it too raises on every rank.
    """
    problem = local_problem(q, k, v, cfg) or extra
    if world_size == 1:
        if problem:
            raise problem[0](f"{fn}: {problem[1]}")
        return
    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    mine = torch.tensor(_signature(q, k, cfg, problem, fn, world_size), dtype=torch.int64, device=device)
    sigs = [torch.empty_like(mine) for _ in range(world_size)]
    try:
        dist.all_gather(sigs, mine, group=group)
    except RuntimeError as e:
        raise RingCommError(f"{fn}: exchanging the input check with the other ranks failed (a rank "
                            f"died or did not enter the call within the process group's timeout): {e}") from e
    stats = active_stats()
    if stats is not None:
        stats.record("forward", "meta", (world_size - 1) * mine.numel() * 8, (world_size - 1) * mine.numel() * 8)
    table = torch.stack(sigs).cpu()
    bad = [r for r in range(world_size) if table[r, 0] != 0]
    if bad:
        # error path only: every rank knows some rank failed, so all enter this exchange together
        texts = [None] * world_size
        dist.all_gather_object(texts, problem[1] if problem else None, group=group)
        if problem:
            raise problem[0](f"{fn}: {problem[1]}")
        detail = "; ".join(f"rank {r}: {texts[r]}" for r in bad)
        raise _KINDS[int(table[bad[0], 0])](f"{fn}: invalid arguments on another rank, all ranks abort "
                                            f"the call ({detail})")
    # the function first: different strategies also differ in their options, which would hide the cause
    for i in [13] + [j for j in range(1, len(_FIELDS)) if j != 13]:
        col = table[:, i].tolist()
        if len(set(col)) > 1:
            decode = {6: DTYPES, 7: LAYOUTS + ("partition",), 9: BACKENDS, 10: BACKWARDS, 12: SCHEDULES}.get(i)
            shown = [str(decode[c]) for c in col] if decode else col
            if i == 13:  # every rank sees the mismatch, so all enter this exchange together
                names = [None] * world_size
                dist.all_gather_object(names, fn, group=group)
                raise ValueError(f"{fn}: the ranks called different functions or strategies: {names} (rank "
                                 f"order); every rank of the group must make the same call")
            if i in (11, 14):
                shown = "differing values"
            raise ValueError(f"{fn}: {_FIELDS[i]} must be the same on every rank of the group, "
                             f"got {shown} (rank order)")

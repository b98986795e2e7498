"""Input checks that fail on EVERY rank, never on one rank while the others hang.

Each rank checks its own arguments locally (:func:`local_problem`), then the ranks compare a named
signature (shapes, dtype, options, checksums of the mask and of small tensor arguments:
:func:`signature`) with :func:`burstattn.comm.agree.agree`, one 8-byte all-gather before any ring
traffic. If any rank found a problem, or the ranks disagree (e.g. different local sequence lengths),
every rank raises the same exception: the problem naming the rank that found it, or the differing
field with its values in rank order.
"""
from __future__ import annotations

import math
import numbers
from typing import Optional

import torch
import torch.distributed as dist

from ..comm.agree import agree
from ..comm.host import host_side
from ..comm.stats import active_stats
from ..config import BACKENDS, BACKWARDS, DEVICE_TYPES, GRAD_PARTIALS, LAYOUTS, SCHEDULES, checksum
from .call import Call

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


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


def softcap_value(softcap):
    """``softcap`` as a Python float; ``None`` and flash-attn's ``0.0`` (off) give ``None``; anything
    else unusable is returned unchanged for :func:`option_problem` to report."""
    value = scale_value(softcap)
    return None if value is None or (isinstance(value, float) and value == 0.0) else value


def dropout_problem(dropout_p) -> Optional[tuple[type, str]]:
    """``dropout_p`` is accepted for flash-attn compatibility; only 0 (exact attention) is."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        return TypeError, f"dropout_p must be a real number, got {type(dropout_p).__name__} {dropout_p!r}"
    if dropout_p != 0:
        return ValueError, (f"dropout_p={dropout_p!r}: attention dropout is not supported (the result is exact "
                            f"attention; a seeded mask independent of the world size is not implemented): pass "
                            f"dropout_p=0.0 and apply dropout outside the attention")
    return None


def option_problem(cfg: Call) -> Optional[tuple[type, str]]:
    """Type problems of the scalar options (``causal`` a bool, ``softmax_scale`` and ``softcap``
    positive reals, ``deterministic`` a bool, ``grad_partials`` a known name)."""
    if not isinstance(cfg.causal, bool):
        return TypeError, f"causal must be a bool (True or False), got {type(cfg.causal).__name__} {cfg.causal!r}"
    for name, s in (("softmax_scale", cfg.softmax_scale), ("softcap", cfg.softcap)):
        if s is not None and (isinstance(s, bool) or not isinstance(s, (int, float))):
            return TypeError, (f"{name} must be None or a real number (float, int, NumPy float, 0-d tensor), "
                               f"got {type(s).__name__} {s!r}")
        if s is not None and (not math.isfinite(s) or s <= 0):
            return ValueError, f"{name} must be None or a positive finite number, got {s!r}"
    if not isinstance(cfg.deterministic, bool):
        return TypeError, f"deterministic must be a bool, got {type(cfg.deterministic).__name__} {cfg.deterministic!r}"
    if cfg.grad_partials not in GRAD_PARTIALS:
        return ValueError, f"grad_partials must be one of {GRAD_PARTIALS}, got {cfg.grad_partials!r}"
    if cfg.device_type is not None and cfg.device_type not in DEVICE_TYPES:
        return ValueError, f"device_type must be None or one of {DEVICE_TYPES}, got {cfg.device_type!r}"
    return None


def _layout_problem(arg: str, layout, local_len: int) -> Optional[tuple[type, str]]:
    if not isinstance(layout, str):
        if not hasattr(layout, "positions_of"):
            return ValueError, f"{arg} must be one of {LAYOUTS} or a Partition, got {type(layout).__name__}"
        if layout.local_len != local_len:
            what = "local_seq (q.shape[1])" if arg == "layout" else "the key shard (k.shape[1])"
            return ValueError, (f"{arg}: the partition gives every rank {layout.local_len} tokens, but "
                                f"{what} is {local_len}")
    elif layout not in LAYOUTS:
        return ValueError, f"{arg} must be one of {LAYOUTS} or a Partition, got {layout!r}"
    elif layout == "zigzag" and local_len % 2:
        what = "local_seq" if arg == "layout" else "the key shard length (k.shape[1])"
        return ValueError, (f"{arg} 'zigzag' needs an even {what} (two chunks per rank), got {local_len}; pad the "
                            f"sequence to a multiple of 2 * world_size")
    return None


def tensor_problem(name: str, x, shapes: tuple, q) -> Optional[tuple[type, str]]:
    """Why the optional tensor argument ``name`` (ALiBi slopes, sink logits) is unusable: it must be
    a floating tensor on q's device with one of ``shapes``."""
    if x is None:
        return None
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        what = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        return TypeError, f"{name} must be a floating-point torch.Tensor, got {what}"
    if tuple(x.shape) not in shapes:
        return ValueError, f"{name} must have shape {' or '.join(str(list(s)) for s in shapes)}, got {list(x.shape)}"
    if x.device != q.device:
        return ValueError, f"{name} must be on q's device {q.device}, got {x.device}"
    return None


def local_problem(q, k, v, cfg: Call, alibi=None, sinks=None) -> Optional[tuple[type, str]]:
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
    if k.shape[:3] != v.shape[:3]:
        return ValueError, (f"k and v must have the same batch, local_seq and kv_heads (v may have its own "
                            f"head_dim), got {tuple(k.shape)} and {tuple(v.shape)}")
    names = ("batch", "local_seq", "heads", "head_dim")
    for i in (0, 3):
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
    if k.shape[1] == 0 or v.shape[3] == 0:
        return ValueError, f"k and v must have a non-empty local_seq and head_dim, got {tuple(k.shape)}, {tuple(v.shape)}"
    problem = _layout_problem("layout", cfg.layout, q.shape[1])
    if problem is None and cfg.kv_layout is not None:
        problem = _layout_problem("kv_layout", cfg.kv_layout, k.shape[1])
    problem = problem or tensor_problem("alibi_slopes", alibi, ((q.shape[2],), (q.shape[0], q.shape[2])), q)
    problem = problem or tensor_problem("sinks", sinks, ((q.shape[2],),), q)
    if problem:
        return problem
    unequal = q.shape[1] != k.shape[1] or cfg.kv_layout is not None
    if cfg.schedule == "distflash" and unequal:
        return ValueError, ("schedule 'distflash' balances causal self-attention (one sequence, equal shards); "
                            "queries and keys of their own lengths or layouts run on schedule='ring'")
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
    if cfg.kv_layout is None and cfg.layout == "zigzag" and k.shape[1] % 2:
        return ValueError, (f"layout 'zigzag' needs an even key shard length (k.shape[1], two chunks per rank), "
                            f"got {k.shape[1]}; pad the key sequence to a multiple of 2 * world_size")
    return None


def _layout_index(layout) -> int:
    return LAYOUTS.index(layout) if isinstance(layout, str) else len(LAYOUTS)


def runs_backward(*tensors) -> bool:
    """Whether this rank will run the attention's backward: grad mode is on and one of ``tensors``
    (q, k, v, the sinks) requires a gradient. Part of the cross-rank check: a rank that skips the
    backward would leave the others waiting in its collectives until the process group's timeout."""
    return torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in tensors)


def values_text(x: Optional[torch.Tensor]) -> str:
    """What a small tensor argument is, for the cross-rank check (ALiBi slopes, sink logits: ``[Hq]`` or
    ``[B, Hq]``): its shape and the checksum of its values as float64; ``"None"``. Read once per call, in
    the cross-rank check (outside any traced region)."""
    if x is None:
        return "None"
    values = x.detach().to(device="cpu", dtype=torch.float64)
    return f"{list(x.shape)}, values crc32 {checksum(values):08x}"


def _layout_text(layout) -> str:
    """A layout name, or an explicit partition by its fingerprint (which ranks hold which positions)."""
    return layout if isinstance(layout, str) else f"partition {layout.fingerprint:08x}"


def _mask_text(cfg: Call, seq_len: int) -> str:
    """The mask by its fingerprint (its values, probed at ``seq_len``: :meth:`burstattn.AttnMask.fingerprint`)."""
    return "None" if cfg.mask is None else f"fingerprint {cfg.mask.fingerprint(seq_len):08x}"


def signature(q, k, v, cfg: Call, fn: str, world_size: int, alibi=None, sinks=None) -> tuple[tuple[str, str], ...]:
    """This rank's cross-rank signature of one call: ``(field, value text)`` pairs that must be equal on
    every rank. The function comes first (reported alone when it differs: different strategies also
    differ in their options, which would hide the cause)."""
    topology = cfg.topology.ranks_per_node if cfg.topology is not None else None
    return (
        (FUNCTION, fn),
        ("batch", str(q.shape[0])),
        ("local_seq (q.shape[1])", str(q.shape[1])),
        ("q_heads", str(q.shape[2])),
        ("kv_heads", str(k.shape[2])),
        ("head_dim", str(q.shape[3])),
        ("dtype", str(q.dtype)),
        ("layout", _layout_text(cfg.layout)),
        ("causal", str(cfg.causal)),
        ("backend", cfg.backend),
        ("backward", cfg.backward),
        ("softmax_scale", repr(cfg.softmax_scale)),
        ("schedule", cfg.schedule),
        ("topology (ranks_per_node)", str(topology)),
        ("mask (window / cu_seqlens / document_ids / mask_mod)", _mask_text(cfg, q.shape[1] * world_size)),
        ("the key shard length (k.shape[1])", str(k.shape[1])),
        ("v's head_dim", str(v.shape[3])),
        ("kv_layout", "same as layout" if cfg.kv_layout is None else _layout_text(cfg.kv_layout)),
        ("softcap", repr(cfg.softcap)),
        ("alibi_slopes (shape and values)", values_text(alibi)),
        ("sinks (shape and values)", values_text(sinks)),
        ("deterministic", str(cfg.deterministic)),
        ("grad_partials", cfg.grad_partials),
        ("device_type", str(cfg.device_type)),
        ("requires_grad (whether this rank runs the backward: grad mode on and q, k, v or sinks requiring grad)",
         str(cfg.grad)),
    )


FUNCTION = "function (burst_attn_func or the attention strategy)"


def check_inputs(q, k, v, cfg: Call, group: Optional[dist.ProcessGroup], world_size: int,
                 fn: str = "burst_attn_func", problem: Optional[tuple[type, str]] = None, alibi=None,
                 sinks=None) -> None:
    """Raise the same error on every rank of ``group`` if any rank's inputs are invalid or the ranks
    disagree (:func:`burstattn.comm.agree.agree` over :func:`signature`; op ``meta`` in the byte meter).

    ``problem``: what this rank found wrong, as ``(TypeError or ValueError, message)``: the local check
    (:func:`local_problem`, run once per call by :func:`burstattn.call.prepare.prepare`, not again
    here) or the mask's; it is shared with the other ranks, so it raises on every rank.
    ``alibi`` / ``sinks``: the call's optional tensors (their shapes and values are compared).
    """
    if world_size == 1:  # one process: nothing to compare (and no call at all in the clean case)
        if problem is not None:
            agree(fn, (), group, problem=problem)
        return
    sig = ()
    if problem is None:
        with host_side():  # real (host) values in a dry run too
            sig = signature(q, k, v, cfg, fn, world_size, alibi, sinks)
    agree(fn, sig, group, problem=problem, alone=(FUNCTION,), stats=active_stats(),
          hint="every rank of the group must make the same call")

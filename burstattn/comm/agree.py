"""The library's one way for every rank to raise: a named signature, or a local problem, checked across a group.

Every rank hands :func:`agree` an ordered signature, ``((field name, value text), ...)``: what must be equal
on every rank of ``group`` (shapes, options, a resolved configuration, a checksum of data), and the
problem it found with its own arguments, if any. The ranks exchange ONE fixed-size digest each
(:data:`DIGEST_INTS` int64: ``-1`` for a problem, else the :func:`~burstattn.config.checksum` of the
whole signature), so the common case costs one all-gather of 8 bytes per rank. Only when some rank
has a problem or the digests differ (every rank sees the same table, so every rank takes this path
together) do they exchange the texts, with one ``all_gather_object``, and then every rank raises the
SAME exception type and message (its lead the callers' ``what``, joined by `` / `` where they differ):

* a problem on some rank: the problem's own type (that of the lowest rank with one) and text, naming
  the rank(s) unless every rank found the same problem (then it reads as it would on one process);
* differing signatures: :class:`Disagreement` (a ``ValueError``) naming each differing field and its
  values in rank order (``fields`` in ``alone`` are reported by themselves: a differing function or
  strategy explains every other difference).

The pure parts (:func:`digest`, :func:`differences`, :func:`problem_error`, :func:`mismatch_error`) need
no process group. A single process (``torch.distributed`` not initialised, a group of one) and the dry
run's fake group (one process standing for every rank; its digest's bytes are metered) raise their own
problem directly. A failed exchange (a rank died) raises :class:`~burstattn.comm.errors.CollectiveError`.

Texts are compared by their CRC-32 (every difference within 32 consecutive bits is caught, others but
for a chance of 2**-32); messages show at most :data:`SHOWN_CHARS` characters of a value. Values are
texts so that anything can be compared: a caller writes ``repr(value)`` (:func:`entries` does), a
:func:`checksum` of data, or what a path resolves to.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Iterable, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist

from ..config import checksum
from .errors import CollectiveError
from .host import host_side
from .stats import CommStats

Signature = Sequence[tuple[str, str]]
"""Ordered ``(field name, value text)`` pairs: what every rank must hold equal."""
Problem = Union[None, str, tuple[type, str], BaseException]
"""This rank's own problem: ``None``; a message (a ``ValueError``); ``(exception class, message)``; or an
exception (its class and ``str``)."""

DIGEST_INTS = 1  # [-1 (a problem) or the signature's CRC-32]
PROBLEM = -1
SHOWN_CHARS = 80
ABSENT = "(absent)"


class Disagreement(ValueError):
    """The ranks' signatures differ. ``fields``: the differing field names, in signature order;
    ``values``: each one's value texts in rank order."""

    def __init__(self, message: str, fields: tuple[str, ...] = (), values: tuple[tuple[str, ...], ...] = ()):
        super().__init__(message)
        self.fields, self.values = fields, values


@dataclass(frozen=True)
class _Raised:
    """What a rank with a problem sends on the error path: its exception class and message."""

    kind: type
    text: str


def entries(values: Union[Mapping[str, object], Iterable[tuple[str, object]]]) -> tuple[tuple[str, str], ...]:
    """A signature from ``name -> value`` pairs, each value's text its ``repr()`` (strings quoted)."""
    pairs = values.items() if isinstance(values, Mapping) else values
    return tuple((str(name), repr(value)) for name, value in pairs)


def _normalise(problem: Problem) -> Optional[_Raised]:
    if problem is None or isinstance(problem, _Raised):
        return problem
    if isinstance(problem, str):
        return _Raised(ValueError, problem)
    if isinstance(problem, BaseException):
        return _Raised(type(problem), str(problem))
    kind, text = problem
    return _Raised(kind, str(text))


def digest(signature: Signature, problem: Problem = None) -> list[int]:
    """The fixed-size digest a rank sends: ``[PROBLEM]`` with a problem, else ``[CRC-32 of the signature]``
    (names and texts, in order: a renamed, reordered or missing field changes it too)."""
    if _normalise(problem) is not None:
        return [PROBLEM]
    text = "\0".join(f"{name}\x01{value}" for name, value in signature)
    return [checksum(f"{len(signature)}\x02{text}")]


def differences(signatures: Sequence[Signature], alone: Collection[str] = ()) -> list[tuple[str, tuple[str, ...]]]:
    """``[(field, values in rank order)]`` of the fields whose texts differ between the ranks' signatures
    (a field some rank lacks shows :data:`ABSENT` there), in the order of their first appearance.
    When a field named in ``alone`` differs, it is returned by itself (the first such)."""
    names = list(dict.fromkeys(name for sig in signatures for name, _ in sig))
    tables = [dict(sig) for sig in signatures]
    found = []
    for name in names:
        values = tuple(t.get(name, ABSENT) for t in tables)
        if len(set(values)) > 1:
            found.append((name, values))
    first = [d for d in found if d[0] in alone]
    return first[:1] if first else found


def _shown(text: str) -> str:
    if len(text) <= SHOWN_CHARS:
        return text
    return f"{text[:SHOWN_CHARS - 20]}... (#{checksum(text):08x})"


def _lead(what: str) -> str:
    return f"{what}: " if what else ""


def mismatch_error(what: str, diffs: Sequence[tuple[str, Sequence[str]]], hint: str = "") -> Disagreement:
    """The :class:`Disagreement` naming every differing field and its values in rank order."""
    if not diffs:  # equal texts under differing digests: not expected (a 64-bit hash collision aside)
        diffs = [("the signature", ("differing digests",))]
    parts = [f"{name} must be the same on every rank of the group, got [{', '.join(_shown(v) for v in values)}] "
             f"(rank order)" for name, values in diffs]
    text = _lead(what) + "; ".join(parts) + (f"; {hint}" if hint else "")
    return Disagreement(text, tuple(n for n, _ in diffs), tuple(tuple(v) for _, v in diffs))


def problem_error(what: str, problems: Sequence[Problem]) -> BaseException:
    """The exception every rank raises when ``problems`` (one per rank, ``None`` where none) holds one:
    the lowest such rank's type; its text alone when every rank found the same, else naming the ranks."""
    found = [(r, p) for r, p in enumerate(_normalise(p) for p in problems) if p is not None]
    world = len(problems)
    kind = found[0][1].kind
    texts = list(dict.fromkeys(p.text for _, p in found))
    if len(texts) == 1:
        ranks = [r for r, _ in found]
        if len(ranks) == world:
            return kind(_lead(what) + texts[0])
        where = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
        return kind(f"{_lead(what)}{texts[0]} ({where} of {world}; every rank aborts)")
    detail = "; ".join(f"rank {r}: {p.text}" for r, p in found)
    return kind(f"{_lead(what)}invalid arguments on {len(found)} of {world} ranks, every rank aborts ({detail})")


def _world(group) -> int:
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def _lead_of(whats: Sequence[str]) -> str:
    """One lead for every rank: the callers' ``what`` (in rank order, each once) joined by `` / ``."""
    return " / ".join(dict.fromkeys(whats))


def agree(what: str, signature: Signature, group: Optional[dist.ProcessGroup], *, problem: Problem = None,
          alone: Collection[str] = (), hint: str = "", stats: Optional[CommStats] = None,
          phase: str = "forward", op: str = "meta") -> None:
    """Return on every rank of ``group`` if no rank has a problem and every rank's ``signature`` is the same;
    else raise the same exception on every rank (module docstring). Every rank of ``group`` must call it.

    Args:
        what: the message's lead (``"burst_attn_func"``, ``"generate"``; ``""``: none).
        signature: this rank's ordered ``(field name, value text)`` pairs (may be empty: problems only).
        group: the process group (``None``: torch's default group; a single process when
            ``torch.distributed`` is not initialised).
        problem: this rank's own problem (:data:`Problem`); it raises on every rank.
        alone: fields reported by themselves when they differ; ``hint``: appended to a mismatch message.
        stats, phase, op: the byte meter and its labels for the digest's all-gather
            (``(P - 1) * 8 * DIGEST_INTS`` bytes sent and received per rank).
    Raises:
        the problem's type (naming the rank), :class:`Disagreement`, or
        :class:`~burstattn.comm.errors.CollectiveError` when the exchange itself fails (a rank died).
    """
    mine = _normalise(problem)
    world = _world(group)
    if world > 1 and stats is not None:
        nbytes = (world - 1) * DIGEST_INTS * 8
        stats.record(phase, op, nbytes, nbytes)
    if world == 1 or dist.get_backend(group) == "fake":  # one process, or one standing for every rank
        if mine is not None:
            raise problem_error(what, [mine])
        return
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    with host_side():  # real tensors inside the dry run's fake tensor mode: the table is read below
        local = torch.tensor(digest(signature, mine), dtype=torch.int64, device=device)
        table = local.repeat(world)
        try:
            getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(table, local, group=group)
        except RuntimeError as e:
            raise CollectiveError(f"{_lead(what)}exchanging the cross-rank check failed (a rank died or did not "
                                  f"reach it within the process group's timeout): {e}") from e
        rows = table.tolist()
    if all(row == rows[0] for row in rows) and rows[0] != PROBLEM:
        return
    # error path: every rank holds this same table, so every rank enters this exchange
    every: list = [None] * world
    try:
        dist.all_gather_object(every, (what, mine if mine is not None else tuple(signature)), group=group)
    except RuntimeError as e:
        raise CollectiveError(f"{_lead(what)}exchanging the cross-rank check's details failed: {e}") from e
    lead = _lead_of([w for w, _ in every])
    if PROBLEM in rows:
        raise problem_error(lead, [p if isinstance(p, _Raised) else None for _, p in every])
    raise mismatch_error(lead, differences([sig for _, sig in every], alone), hint)

"""Which degree choices the planner may offer, and why the others are excluded (pure).

:func:`degree_problem` is the planner's cut on ``(cp, tp)`` (``dp`` takes the rest of the GPUs):
a tensor-parallel group inside one node that divides the heads, a sequence that splits into
``2 * cp`` chunks, a global batch that splits over ``dp``. :func:`exclusions` counts, per
constraint, the configurations each one excluded, so that "nothing runs" can say why (``burstattn
plan --gpus 3`` on a 4-head model at 4,096 tokens: nothing divides by 3).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Optional

from ..models.config import LlamaConfig


@dataclass(frozen=True)
class Exclusion:
    """One constraint and how many configurations it excluded (``example``: one of them)."""

    constraint: str
    """``tp-node``, ``tp-heads``, ``seq-split``, ``batch-dp`` or ``train-check`` (``burstattn train``'s own)."""
    why: str
    count: int
    example: str

    def to_dict(self) -> dict:
        return {"constraint": self.constraint, "why": self.why, "count": self.count, "example": self.example}


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def degree_problem(model: LlamaConfig, gpus: int, devices_per_node: int, seq_len: int, batch: int, cp: int,
                   tp: int) -> Optional[tuple[str, str]]:
    """``(constraint, why)`` when degrees ``cp`` x ``tp`` (``dp = gpus / (cp tp)``) cannot run, else ``None``."""
    dp = gpus // (cp * tp)
    if tp > devices_per_node:
        return "tp-node", f"tp larger than a node ({devices_per_node} devices)"
    if model.n_heads % tp:
        return "tp-heads", f"the model's {model.n_heads} heads do not divide by tp"
    if cp > 1 and seq_len % (2 * cp):
        return "seq-split", f"--seq-len {seq_len} does not divide by 2 x cp (two chunks per rank)"
    if batch % dp:
        return "batch-dp", f"--batch {batch} does not divide by dp (the GPUs left over cp x tp)"
    return None


def degree_choices(model: LlamaConfig, gpus: int, devices_per_node: int, seq_len: int,
                   batch: int) -> Iterable[tuple[int, int, Optional[tuple[str, str]]]]:
    """Every ``(cp, tp, problem)`` with ``cp * tp`` dividing ``gpus`` (``problem``: :func:`degree_problem`)."""
    for tp in divisors(gpus):
        for cp in divisors(gpus // tp):
            yield cp, tp, degree_problem(model, gpus, devices_per_node, seq_len, batch, cp, tp)


def exclusions(model: LlamaConfig, gpus: int, devices_per_node: int, seq_len: int, batch: int,
               train_problems: Iterable[tuple[str, int, int, str]] = ()) -> list[Exclusion]:
    """Per constraint, the degree choices it excluded (most first), and the strategies ``burstattn
    train`` refuses (``train_problems``: ``(strategy label, cp, tp, message)``, one per refused one)."""
    counts: Counter = Counter()
    example: dict = {}
    for cp, tp, problem in degree_choices(model, gpus, devices_per_node, seq_len, batch):
        if problem is not None:
            counts[problem] += 1
            example.setdefault(problem, f"dp={gpus // (cp * tp)} cp={cp} tp={tp}")
    for label, cp, tp, message in train_problems:
        key = ("train-check", f"burstattn train refuses it: {message}")
        counts[key] += 1
        example.setdefault(key, f"{label} dp={gpus // (cp * tp)} cp={cp} tp={tp}")
    return [Exclusion(c, why, n, example[(c, why)]) for (c, why), n in counts.most_common()]


def nothing_runs(gpus: int, seq_len: int, excluded: list[Exclusion]) -> str:
    """The planner's one paragraph when no configuration is left: each constraint with its count."""
    total = sum(e.count for e in excluded)
    lines = [f"nothing runs on {gpus} GPUs at --seq-len {seq_len}: the {total} configuration(s) tried were "
             "excluded, by constraint:"]
    lines += [f"  {e.count:>4} x {e.why} (e.g. {e.example})" for e in excluded]
    return "\n".join(lines)


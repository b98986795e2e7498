"""``burstattn plan --max-seq-len --verify [K]``: only lengths a dry run confirms fit, with headroom.

For each of the K longest answers the plan row of that strategy and degrees is taken from the planner's
ranking at that length and its ``burstattn train`` command is dry-run (rank 0, :mod:`.verify`). A length is
confirmed when the dry run's peak leaves :data:`HEADROOM` of the device memory free; otherwise the length
is shortened by the ratio of that limit to the dry run's peak (down to a multiple of the plan's sequence
step) and dry-run again with the same options where the ranking there has that plan, at most :data:`TRIES`
times. Every check is reported (length, predicted and dry-run
peak, whether it fits); an answer no check confirmed says so (``confirmed_tokens: None``).
"""
from __future__ import annotations

from typing import Callable, Optional

from ..sim.memory import HEADROOM  # the one headroom of every answer (the planner's too)

TRIES = 3


def _row(rows: list[dict], label: str, degrees: dict, command: Optional[str] = None) -> Optional[dict]:
    """The first row of ``label`` at ``degrees``; with ``command`` (the first check's, its ``--seq-len``
    changed), the row of that same plan if the ranking has it: a shortened length keeps its options, so its
    peak falls with the length (the planner's best row there may fill the memory again with other options)."""
    match = [r for r in rows if r["strategy"] == label and r["degrees"] == degrees and "train" in r.get("config", {})]
    same = [r for r in match if command is not None and r["config"]["train"] == command]
    return (same or match or [None])[0]


def _shorter(checks: list[dict], limit: float, step: int) -> int:
    """The next length to try, a multiple of ``step`` at least one step shorter: where the peak would meet
    ``limit`` on the line through the last two checks (the same plan: the peak is a fixed part plus a part
    that grows with the length), else the last length scaled by ``limit / peak`` (as if it all grew)."""
    last = checks[-1]
    t, p = last["tokens"], last["dry_run_peak_bytes"]
    guess = t * limit / p
    if len(checks) >= 2 and "dry_run_peak_bytes" in checks[-2]:
        t0, p0 = checks[-2]["tokens"], checks[-2]["dry_run_peak_bytes"]
        if t0 != t and p0 > p:
            guess = t + (limit - p) * (t0 - t) / (p0 - p)
    return min(int(guess) // step * step, (t // step - 1) * step)


def _predicted(command: str) -> float:
    """The memory model's peak of a ``burstattn train`` command (what the planner computes for it)."""
    from .verify import command_model

    return command_model(command)[2].peak


def _with_length(command: str, tokens: int) -> str:
    words = command.split()
    words[words.index("--seq-len") + 1] = str(tokens)
    return " ".join(words)


def confirm_lengths(res: dict, k: int, ranking: Callable[[int], list[dict]], capacity: float,
                    granularity: int = 1024, host_capacity: float = float("inf")) -> list[dict]:
    """The ``k`` longest answers of ``res`` (``max_seq_len``'s ``{label: {"tokens", "degrees", ...}}``), each
    ``{"strategy", "degrees", "planned_tokens", "confirmed_tokens", "headroom", "checks": [...]}`` (a check:
    ``tokens``, ``predicted_peak_bytes``, ``dry_run_peak_bytes``, ``dry_run_host_bytes``, ``fits``; or
    ``dry_run_error``). ``ranking(tokens)``: the planner's rows at that length; ``capacity``: device bytes;
    ``host_capacity``: the host bytes one device may fill (``sim.step.host_capacity``): a length whose dry
    run's host copies (pinned, as a GPU allocates them) exceed it is not confirmed either."""
    from ..train.dryrun import DryRunError, dry_run
    from .verify import train_config

    limit = (1.0 - HEADROOM) * capacity
    out = []
    for label, v in sorted(res.items(), key=lambda kv: -kv[1]["tokens"])[:k]:
        tokens, checks, confirmed, first = v["tokens"], [], None, None
        step = granularity * 2 * max(1, v["degrees"]["cp"])
        for _ in range(TRIES):
            same = None if first is None else _with_length(first, tokens)
            row = _row(ranking(tokens), label, v["degrees"], same) if tokens > 0 else None
            if row is None:
                break
            if same is not None and row["config"]["train"] != same:  # not in the ranking: the model of it
                row = {"config": {"train": same}, "peak_memory_bytes": _predicted(same)}
            first = first or row["config"]["train"]
            cfg, world = train_config(row["config"]["train"])
            try:
                dry = dry_run(cfg, world, 0)
            except DryRunError as exc:
                checks.append({"tokens": tokens, "dry_run_error": str(exc)})
                break
            peak, host = dry["peak_bytes"], dry["host_bytes"]
            fits = peak <= limit and host <= host_capacity
            checks.append({"tokens": tokens, "predicted_peak_bytes": int(row["peak_memory_bytes"]),
                           "dry_run_peak_bytes": int(peak), "dry_run_host_bytes": int(host), "fits": fits,
                           "command": row["config"]["train"], "dry_run_seconds": dry["seconds"],
                           "dry_run_cpu_s": dry.get("cpu_seconds")})
            if fits:
                confirmed = tokens
                break
            tokens = _shorter(checks, limit, step) if peak > limit else \
                min(int(tokens * host_capacity / host) // step * step, (tokens // step - 1) * step)
        out.append({"strategy": label, "degrees": v["degrees"], "planned_tokens": v["tokens"],
                    "confirmed_tokens": confirmed, "headroom": HEADROOM, "checks": checks})
    return out


def format_confirmed(rows: list[dict], capacity: float) -> str:
    """One line per answer and one per check."""
    from ..sim.names import size

    lines = [f"dry-run check of the longest lengths (rank 0; confirmed when the peak leaves {HEADROOM:.0%} of "
             f"{size(capacity)} free: at most {size((1 - HEADROOM) * capacity)}):"]
    for r in rows:
        d = r["degrees"]
        got = f"{r['confirmed_tokens']:,} tokens confirmed" if r["confirmed_tokens"] else "no length confirmed"
        lines.append(f"  {r['strategy']} (dp={d['dp']} cp={d['cp']} tp={d['tp']}): planned {r['planned_tokens']:,}; {got}")
        for c in r["checks"]:
            if "dry_run_error" in c:
                lines.append(f"    {c['tokens']:>12,}: no dry run: {c['dry_run_error']}")
                continue
            lines.append(f"    {c['tokens']:>12,}: predicted {size(c['predicted_peak_bytes'])}, dry run "
                         f"{size(c['dry_run_peak_bytes'])}, host {size(c.get('dry_run_host_bytes', 0))}: "
                         f"{'fits' if c['fits'] else 'over the limit'}")
    return "\n".join(lines)

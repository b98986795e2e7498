"""Document sources for dispatch: each step's global batch as a list of variable-length documents.

Every source is a pure function of ``(seed, step)`` (the same batch on every rank, at every world
size): a step holds ``batch x seq_len`` tokens cut into documents.

* :class:`SyntheticDocs` (``--doc-lengths lognormal:MEDIAN,SIGMA,MAX``): long-tailed lengths drawn
  from a log-normal (median, sigma of the log) clipped to ``[2, MAX]``; each document a random phrase
  repeated (learnable by copying, as the passkey filler).
* :class:`FileDocs` (``--data`` with ``--eod-id`` or ``--doc-offsets``): a random window of the token
  file, cut after every end-of-document token, or at the offsets file's document starts.
* :func:`load_histogram`: a length histogram file (``LENGTH COUNT`` per line) for the simulator.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from .data import LETTERS, FileData, _generator, encode

MIN_DOC = 2  # a document of one token has no target


@dataclass(frozen=True)
class DocLengths:
    """``lognormal:MEDIAN,SIGMA,MAX`` parsed."""

    median: float
    sigma: float
    max_len: int

    @classmethod
    def parse(cls, text: str) -> "DocLengths":
        """Raises ``ValueError`` naming ``--doc-lengths`` and the expected form."""
        expect = "--doc-lengths expects lognormal:MEDIAN,SIGMA,MAX (e.g. lognormal:512,1.5,32768)"
        kind, _, rest = str(text).partition(":")
        parts = rest.split(",")
        if kind != "lognormal" or len(parts) != 3:
            raise ValueError(f"{expect}, got {text!r}")
        try:
            median, sigma, top = float(parts[0]), float(parts[1]), int(parts[2])
        except ValueError:
            raise ValueError(f"{expect}, got {text!r}") from None
        if median < MIN_DOC or sigma < 0 or top < max(MIN_DOC, median):
            raise ValueError(f"{expect} with MEDIAN >= {MIN_DOC}, SIGMA >= 0 and MAX >= MEDIAN, got {text!r}")
        return cls(median, sigma, top)

    def sample(self, total: int, gen: torch.Generator) -> list[int]:
        """Lengths summing to ``total`` (the last one cut to fit; a remainder below 2 joins the one before)."""
        def draw() -> int:
            z = float(torch.randn((), generator=gen, dtype=torch.float64))
            return int(min(self.max_len, max(MIN_DOC, round(self.median * math.exp(self.sigma * z)))))
        return _fill(total, draw)


def _fill(total: int, draw) -> list[int]:
    """Lengths ``draw()`` until they sum to ``total`` (the last cut to fit; a piece below 2 joins the one before)."""
    out, left = [], total
    while left > 0:
        n = min(draw(), left)
        if n < MIN_DOC and out:
            out[-1] += n
        else:
            out.append(n)
        left -= n
    return out


@dataclass(frozen=True)
class HistogramLengths:
    """Lengths drawn from a histogram file's ``(length, count)`` rows (:func:`load_histogram`), with
    :meth:`DocLengths.sample`'s contract."""

    rows: tuple

    def sample(self, total: int, gen: torch.Generator) -> list[int]:
        lengths = torch.tensor([r[0] for r in self.rows], dtype=torch.int64)
        weights = torch.tensor([float(r[1]) for r in self.rows], dtype=torch.float64)
        return _fill(total, lambda: int(lengths[int(torch.multinomial(weights, 1, generator=gen))]))


def _phrase_doc(n: int, gen: torch.Generator) -> torch.Tensor:
    length = int(torch.randint(4, 33, (1,), generator=gen))
    phrase = "".join(LETTERS[int(i)] for i in torch.randint(0, len(LETTERS), (length,), generator=gen)) + ". "
    return encode(phrase * (n // len(phrase) + 1))[:n]


class SyntheticDocs:
    """Documents of long-tailed lengths (:class:`DocLengths`), ``batch x seq_len`` tokens per step."""

    def __init__(self, spec: str, seed: int, batch: int, seq_len: int) -> None:
        self.lengths, self.seed, self.total = DocLengths.parse(spec), seed, batch * seq_len

    def documents(self, step: int) -> list[torch.Tensor]:
        """The step's documents: int64 ``[L_i]`` each, ``sum L_i = batch x seq_len``."""
        gen = _generator(self.seed, step, 7)
        return [_phrase_doc(n, gen) for n in self.lengths.sample(self.total, gen)]


class FileDocs:
    """A random window of ``batch x seq_len`` tokens of a token file, cut into documents after each
    ``eod_id`` token, or at the starts listed in ``offsets`` (a text file, one token offset a line).

    Raises:
        ValueError: naming ``--data``, ``--eod-id`` or ``--doc-offsets`` (missing, unparsable, both given).
    """

    def __init__(self, path: str, fmt: str, seed: int, batch: int, seq_len: int, *, eod_id: Optional[int] = None,
                 offsets: Optional[str] = None) -> None:
        if (eod_id is None) == (offsets is None):
            raise ValueError("--data documents need exactly one of --eod-id or --doc-offsets")
        self.file = FileData(path, fmt, seed, 1, batch * seq_len)
        self.eod_id, self.starts = eod_id, None
        if offsets is not None:
            starts = load_offsets(offsets)
            self.starts = torch.tensor(sorted(set(starts) | {0}), dtype=torch.int64)

    def documents(self, step: int) -> list[torch.Tensor]:
        gen = _generator(self.file.seed, step)
        total = self.file.seq_len
        s = int(torch.randint(0, len(self.file.ids) - total + 1, (1,), generator=gen))
        window = self.file.ids[s:s + total]
        if self.eod_id is not None:
            cuts = (torch.nonzero(window == self.eod_id).flatten() + 1).tolist()
        else:
            cuts = (self.starts[(self.starts > s) & (self.starts < s + total)] - s).tolist()
        edges = [0] + [c for c in cuts if 0 < c < total] + [total]
        docs = [window[a:b] for a, b in zip(edges[:-1], edges[1:])]
        merged: list[torch.Tensor] = []
        for d in docs:  # a one-token piece has no target: it joins its neighbour
            if d.numel() < MIN_DOC and merged:
                merged[-1] = torch.cat([merged[-1], d])
            else:
                merged.append(d)
        if merged[0].numel() < MIN_DOC and len(merged) > 1:
            merged[1] = torch.cat([merged[0], merged[1]])
            merged = merged[1:]
        return merged


def _parse_lines(path: str, what: str, width: int) -> list[list[int]]:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{what}: no such file {path!r}")
    rows = []
    for no, line in enumerate(p.read_text().splitlines(), 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        fields = text.replace(",", " ").split()
        try:
            values = [int(f) for f in fields]
        except ValueError:
            values = []
        if len(values) != width or any(v < 0 for v in values):
            form = "LENGTH COUNT" if width == 2 else "OFFSET"
            raise ValueError(f"{what}: {path}:{no}: cannot parse {line.strip()!r} (expected {form}, non-negative ints)")
        rows.append(values)
    if not rows:
        raise ValueError(f"{what}: {path} holds no entry")
    return rows


def load_offsets(path: str) -> list[int]:
    """Document start offsets, one int a line (``#`` comments). ``ValueError`` names the file and line."""
    return [r[0] for r in _parse_lines(path, "--doc-offsets", 1)]


def load_histogram(path: str) -> list[tuple[int, int]]:
    """A length histogram: ``LENGTH COUNT`` per line (``#`` comments, blank lines). Returns
    ``[(length, count)]``. Raises ``ValueError`` with one line naming the file and the line."""
    rows = _parse_lines(path, "histogram", 2)
    bad = [r for r in rows if r[0] < 1]
    if bad:
        raise ValueError(f"histogram: {path}: a length must be positive, got {bad[0][0]}")
    if not any(count for _, count in rows):  # nothing to draw a length from
        raise ValueError(f"histogram: {path}: every count is 0 (expected LENGTH COUNT with a positive count)")
    return [(a, b) for a, b in rows]

"""Training data without a download: a synthetic passkey-retrieval task, or a local file.

Every source is a pure function of ``(seed, step)``: each rank builds the same GLOBAL batch
``tokens [batch, seq_len]`` (int64) and keeps its data-parallel rows and context-parallel
positions, so the data is the same whatever the world size and layout, and the data position of
a checkpoint is just the step.

Byte-level tokenizer: a UTF-8 byte is its own token id (vocabulary 256).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ..config import checksum

LETTERS = "abcdefghijklmnopqrstuvwxyz"
KEY_DIGITS = 4


@dataclass(frozen=True)
class Batch:
    """A global batch: ``tokens [B, N]`` int64 and ``answer [B, N]`` bool (True at the label
    positions whose target is an answer token; all False for plain text)."""

    tokens: torch.Tensor
    answer: torch.Tensor


def encode(text: str) -> torch.Tensor:
    """Byte-level tokenizer: UTF-8 bytes as int64 ids ``[len]``."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.int64)


def decode(ids) -> str:
    """Inverse of :func:`encode` (invalid UTF-8 replaced)."""
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def _generator(seed: int, step: int, row: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 4099 + row)


class PasskeyData:
    """Passkey retrieval (Mohtashami & Jaggi 2023): filler, `` The pass key is #NNNN. `` at a random
    depth, and the question `` What is the pass key? The pass key is #NNNN`` ending the sequence.
    Only attending back to the key predicts the final digits, so their accuracy measures
    long-context retrieval. The filler is a random phrase (per sequence) repeated: predicting it
    also takes looking back, which teaches the small model to copy (induction heads) early.

    Raises:
        ValueError: ``seq_len`` too short for the needle and the question (96 tokens at least).
    """

    MIN_LEN = 96
    NEEDLE, QUESTION = " The pass key is #{key}. ", " What is the pass key? The pass key is #{key}"

    @classmethod
    def largest_id(cls) -> int:
        """The largest token id a row can hold (byte-level: ``ord('z')`` = 122, from the filler's
        letters): a model needs ``vocab_size > largest_id()``."""
        digits = "0123456789"
        # bytes, not encode(): a host-side check, also inside the dry run's fake tensor mode
        return max((LETTERS + ". " + cls.NEEDLE.format(key=digits) + cls.QUESTION.format(key=digits)).encode("utf-8"))

    def __init__(self, seed: int, batch: int, seq_len: int) -> None:
        if seq_len < self.MIN_LEN:
            raise ValueError(f"the passkey task needs seq_len >= {self.MIN_LEN}, got {seq_len}")
        self.seed, self.batch_size, self.seq_len = seed, batch, seq_len

    def row(self, step: int, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence ``[N]`` and its answer mask ``[N]`` (True at the labels that are key digits)."""
        gen = _generator(self.seed, step, row)
        key = "".join(str(int(d)) for d in torch.randint(0, 10, (KEY_DIGITS,), generator=gen))
        needle = encode(self.NEEDLE.format(key=key))  # '#' and digits appear nowhere else
        question = encode(self.QUESTION.format(key=key))
        room = self.seq_len - len(question) - len(needle)
        # phrases of 8 to N/3 letters: copies from near and far, like the key's (RoPE must not learn
        # copying at one distance only)
        length = int(torch.randint(8, max(9, self.seq_len // 3), (1,), generator=gen))
        words = torch.randint(0, len(LETTERS), (length,), generator=gen)
        phrase = "".join(LETTERS[int(i)] for i in words) + ". "
        filler = encode(phrase * (room // len(phrase) + 1))[:room]
        depth = int(torch.randint(0, room + 1, (1,), generator=gen))
        tokens = torch.cat([filler[:depth], needle, filler[depth:], question])
        answer = torch.zeros(self.seq_len, dtype=torch.bool)
        answer[self.seq_len - 1 - KEY_DIGITS:self.seq_len - 1] = True  # labels whose targets are the digits
        return tokens, answer

    def batch(self, step: int) -> Batch:
        rows = [self.row(step, r) for r in range(self.batch_size)]
        return Batch(torch.stack([t for t, _ in rows]), torch.stack([a for _, a in rows]))


class FileData:
    """Random windows of a local token file: uint16 / uint32 ids (nanoGPT's ``.bin`` convention,
    no header) or UTF-8 text through the byte-level tokenizer.

    Raises:
        ValueError: the file is missing, has a bad format name, or is shorter than ``seq_len``.
    """

    def __init__(self, path: str, fmt: str, seed: int, batch: int, seq_len: int) -> None:
        p, fmt = _token_file(path, fmt)
        raw = p.read_bytes()
        if fmt == "text":
            self.ids = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int64)
        else:
            dtype = torch.uint16 if fmt == "uint16" else torch.uint32
            self.ids = torch.frombuffer(bytearray(raw), dtype=dtype).to(torch.int64)
        if len(self.ids) < seq_len:
            raise ValueError(f"--data: {path!r} holds {len(self.ids)} tokens, fewer than seq_len {seq_len}")
        self.format, self.seed, self.batch_size, self.seq_len = fmt, seed, batch, seq_len

    @staticmethod
    def guess_format(path: Path) -> str:
        if path.suffix in (".txt", ".md", ".text"):
            return "text"
        return "uint32" if path.suffix in (".u32", ".uint32") else "uint16"

    def batch(self, step: int) -> Batch:
        gen = _generator(self.seed, step)
        starts = torch.randint(0, len(self.ids) - self.seq_len + 1, (self.batch_size,), generator=gen)
        tokens = torch.stack([self.ids[s:s + self.seq_len] for s in starts.tolist()])
        return Batch(tokens, torch.zeros_like(tokens, dtype=torch.bool))


WIDTHS = {"text": 1, "uint16": 2, "uint32": 4}


def _token_file(path: str, fmt: str) -> tuple[Path, str]:
    """The file and its format (``auto`` resolved); ``ValueError`` naming ``--data`` / ``--data-format``
    for a missing file, an unknown format or a length that is not a whole number of ids."""
    p = Path(path)
    expects = "--data expects one token file: uint16 / uint32 ids (nanoGPT's .bin) or UTF-8 text"
    if p.is_dir():
        raise ValueError(f"--data: {path!r} is a directory; {expects}")
    if not p.is_file():
        raise ValueError(f"--data: no such file {path!r} ({expects})")
    fmt = FileData.guess_format(p) if fmt == "auto" else fmt
    if fmt not in WIDTHS:
        raise ValueError(f"--data-format must be auto, uint16, uint32 or text, got {fmt!r}")
    size = p.stat().st_size
    if size % WIDTHS[fmt]:
        raise ValueError(f"--data: {path!r} has {size} bytes, not a multiple of {WIDTHS[fmt]} ({fmt})")
    return p, fmt


def scan_tokens(path: str, fmt: str = "auto") -> tuple[int, int]:
    """``(tokens, largest id)`` of a token file, read through a memory map in chunks (no copy of the
    file in memory). Raises ``ValueError`` as :class:`FileData` does."""
    import numpy as np

    p, fmt = _token_file(path, fmt)
    ids = np.memmap(p, dtype={"text": np.uint8, "uint16": np.uint16, "uint32": np.uint32}[fmt], mode="r") \
        if p.stat().st_size else np.zeros(0, np.uint8)
    chunk = 1 << 24
    largest = max((int(ids[i:i + chunk].max()) for i in range(0, len(ids), chunk)), default=-1)
    return len(ids), largest


def content_id(path: str) -> str:
    """``"<size> bytes, crc32 <hex>"`` of the file at ``path``: what it holds, wherever it lies (read in
    16 MiB chunks: one pass over the file, as :class:`FileData` makes anyway)."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc, size = checksum(chunk, crc), size + len(chunk)
    return f"{size} bytes, crc32 {crc:08x}"


def make_data(data: Optional[str], fmt: str, seed: int, batch: int, seq_len: int):
    """The source of a run: :class:`FileData` for a path, else :class:`PasskeyData`."""
    if data:
        return FileData(data, fmt, seed, batch, seq_len)
    return PasskeyData(seed, batch, seq_len)

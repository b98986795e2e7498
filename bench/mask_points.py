"""The points of ``burstattn bench masks`` (:mod:`.masks`): a mask described by its shape, so that it
scales to any length; shared by the runner and the report (:mod:`.masks_report`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class MaskPoint:
    """One benchmark point; the mask is described by shape so that it scales to any length."""

    suite: str
    name: str
    seq_len: int
    causal: bool
    layout: str                  # "contiguous" | "zigzag" | "striped" | "documents" (document_partition)
    schedule: str = "ring"
    window_div: int = 0          # > 0: causal window (seq_len // window_div, 0)
    documents: int = 0           # > 0: that many packed documents (packed_documents(..., doc_seed))
    doc_seed: int = 0
    heads: int = 8
    kv_heads: int = 8
    head_dim: int = 64
    batch: int = 1
    dtype: str = "float32"
    repeats: int = 3
    warmup: int = 0
    check_seq_len: int = 1024
    check_rows: int = 8
    target: Optional[float] = None  # max fwd+bwd time ratio (masks: vs dense causal; distflash: vs non-causal)


def packed_documents(seq_len: int, documents: int, seed: int) -> list[int]:
    """``cu_seqlens`` of ``documents`` packed documents: ``documents - 1`` cut points at fractions
    drawn uniformly (``torch.Generator().manual_seed(seed)``), sorted and scaled to ``seq_len``, so a
    seed gives the same shape at every length. Raises ValueError if two cuts coincide."""
    gen = torch.Generator().manual_seed(seed)
    fracs = torch.rand(documents - 1, generator=gen, dtype=torch.float64).sort().values
    cu = [0] + [round(float(f) * seq_len) for f in fracs] + [seq_len]
    if any(b <= a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"{documents} documents with seed {seed} give an empty document at N={seq_len}: {cu}")
    return cu


def point_mask(p: MaskPoint, seq_len: int):
    """The point's :class:`burstattn.masks.AttnMask` at ``seq_len`` tokens (``None``: dense)."""
    from burstattn.masks import AttnMask

    if p.window_div:
        return AttnMask(window=(seq_len // p.window_div, 0))
    if p.documents:
        return AttnMask(cu_seqlens=packed_documents(seq_len, p.documents, p.doc_seed))
    return None


def point_layout(p: MaskPoint, seq_len: int, world: int):
    """A layout name, or the :class:`~burstattn.layouts.partition.Partition` of ``layout="documents"``."""
    if p.layout != "documents":
        return p.layout
    from burstattn.layouts.partition import document_partition  # ImportError -> the point is reported unavailable

    return document_partition(packed_documents(seq_len, p.documents, p.doc_seed), world, causal=p.causal)

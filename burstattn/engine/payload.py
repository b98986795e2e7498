"""Packing several tensors (of different dtypes) into one flat byte buffer per ring step.

One buffer per step means one message per hop. Fields are laid out in the order given, each
at an offset aligned to its element size; callers list wider dtypes first so that no
padding is ever needed (then the bytes on the wire are exactly the sum of the fields).
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch


@dataclass(frozen=True)
class Field:
    """One tensor of the payload."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


class Packer:
    """Layout of a payload; :meth:`alloc` a buffer, :meth:`views` to read/write its fields."""

    def __init__(self, fields: list[Field]) -> None:
        self.fields = fields
        self.offsets: list[int] = []
        off = 0
        for f in fields:
            size = torch.empty((), dtype=f.dtype).element_size()
            off = -(-off // size) * size
            self.offsets.append(off)
            off += f.nbytes
        self.nbytes = off

    def alloc(self, device: torch.device) -> torch.Tensor:
        """An uninitialised ``uint8`` buffer of :attr:`nbytes`."""
        return torch.empty(self.nbytes, dtype=torch.uint8, device=device)

    def views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed views of ``buf``'s fields (writing a view writes the buffer)."""
        return {f.name: buf[o:o + f.nbytes].view(f.dtype).view(f.shape)
                for f, o in zip(self.fields, self.offsets)}

    def pack(self, tensors: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor:
        """A new buffer holding copies of ``tensors`` (one per field name)."""
        buf = self.alloc(device)
        for name, view in self.views(buf).items():
            view.copy_(tensors[name])
        return buf

"""The bottom vocabulary: the names of layouts, backends, backward rings, schedules and gradient
partials; the window convention; dtype names and the accumulators' dtype rule; the ignore index of
the loss; the one checksum. Plain values, imported by every layer (nothing here imports the rest of the
package)."""
from __future__ import annotations

import sys
import zlib
from typing import TYPE_CHECKING, Optional, Union

if TYPE_CHECKING:
    import torch

LAYOUTS = ("contiguous", "zigzag", "striped")
BACKENDS = ("auto", "reference", "cpu_flash", "sdpa", "flash_attn")
BACKWARDS = ("auto", "burst", "kv")
SCHEDULES = ("ring", "distflash", "double")
GRAD_PARTIALS = ("auto", "float32", "kernel")
DEVICE_TYPES = ("cpu", "cuda")  # what a step may be modelled on (Call.device_type)

Window = Optional[tuple[Optional[int], Optional[int]]]


def normalize_window(window, name: str = "window") -> Window:
    """The one window validator: ``window`` as ``(left, right)`` with ``None`` for an unbounded side,
    or ``None`` for no window at all.

    Accepts ``None``, or a pair of ints ``>= 0``, ``None`` or ``-1`` (flash-attn's ``window_size``
    convention: ``-1`` is an unbounded side, ``(-1, -1)`` no window). Query ``i`` then sees keys
    ``i - left <= j <= i + right``. Raises ``ValueError`` naming ``name`` and the bad entry.
    """
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(f"{name} must be a pair (left, right) of ints >= 0, None or -1 (unbounded), or None, "
                         f"got {window!r}")
    out = []
    for side, w in zip(("left", "right"), window):
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < -1):
            raise ValueError(f"{name} {side} must be an int >= 0, or None / -1 (unbounded), got {w!r}")
        out.append(None if w is None or w == -1 else int(w))
    return None if out == [None, None] else (out[0], out[1])


LOW_DTYPES = ("float32", "bfloat16", "float16")  # what models train and benchmarks run in, by name
DTYPE_NAMES = LOW_DTYPES + ("float64",)          # float64: the exact checks


def torch_dtype(name: str) -> "torch.dtype":
    """The torch dtype named ``name`` (one of :data:`DTYPE_NAMES`); ``ValueError`` otherwise."""
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {list(DTYPE_NAMES)}, got {name!r}")
    import torch

    return getattr(torch, name)


def accum_dtype(dtype: "torch.dtype") -> "torch.dtype":
    """The dtype partial results accumulate in for inputs of ``dtype``: float64 stays float64 (the exact
    checks), everything else (float32, bfloat16, float16) float32. The one rule: kernels, merges, reductions
    and recurrences all ask here."""
    import torch  # already imported by whoever holds a torch dtype; this module imports nothing at load

    return torch.float64 if dtype == torch.float64 else torch.float32


IGNORE_INDEX = -100
"""The label of positions without a target: PyTorch's ``cross_entropy`` and transformers' ``ignore_index``."""
def checksum(data: Union[str, bytes, bytearray, memoryview, "torch.Tensor"], value: int = 0) -> int:
    """The library's one checksum: CRC-32 (``zlib.crc32``, an int in ``[0, 2**32)``), equal in every process.

    ``data``: text (its UTF-8 bytes), bytes, or a tensor (its values' bytes in row-major order, read on the
    host: any dtype, any device; the shape and dtype are not included, name them beside it).
    ``value``: a previous checksum to continue (``checksum(b, checksum(a)) == checksum(a + b)``).
    Cheap (a few GB/s) and detects every difference confined to 32 consecutive bits; not a
    cryptographic hash. Used for the cross-rank check's digest and for what it compares (data, masks,
    layouts), and for fingerprints of partitions and files.
    """
    if isinstance(data, str):
        data = data.encode("utf-8", "surrogatepass")
    elif not isinstance(data, (bytes, bytearray, memoryview)):  # a tensor: its bytes, whatever the dtype
        import torch

        data = data.detach().reshape(-1).cpu().contiguous().view(torch.uint8).numpy()
    return zlib.crc32(data, value)


def __getattr__(name: str):
    # names that moved out of this module (the table burstattn.MOVED): resolved, or refused with the new spelling
    return sys.modules["burstattn"].moved_attribute(__name__, name)

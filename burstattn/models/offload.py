"""Offload of saved activations to host memory: ``offload = "none" | "inputs" | "all"``.

Between a layer's forward and its backward the model keeps a few tensors per layer (with
``remat``: the layer input, the attention output and its log-sum-exp). :class:`HostOffload`
moves them to host memory as they are saved and brings them back when the backward unpacks
them (``torch.autograd.graph.saved_tensors_hooks``), so device memory holds them only while
their layer computes:

* ``"inputs"``: the tensors marked as layer inputs (:meth:`HostOffload.mark`: every block's
  input and the final hidden state before the loss head). These are what the checkpoint of
  each layer keeps (``full``, ``remat``) or saves first (``none``).
* ``"all"``: every tensor a layer saves; under ``remat`` also the attention outputs and LSE
  that the attention op's cache keeps (:mod:`.remat`).

On CUDA the copy to pinned host memory runs on a side stream (overlapping the forward's
compute; the device block is held until the copy has finished, ``record_stream``) and the copy
back runs on the compute stream when the backward needs it. On CPU the tensors are already in
host memory: nothing is copied (``copy_on_cpu=True``, for tests, makes a real copy so that the
same bookkeeping is exercised). Views of one storage (the chunks of a blockwise MLP) share one
host copy; each unpack copies back only its own view.

Pinned host memory as it is allocated: PyTorch's pinned (page-locked) host allocator rounds every block up
to a power of two (``ATen/core/CachingHostAllocator.h``; a 6.4 GiB layer input would take 8 GiB), so that
freed blocks are reused by size. The allocator setting ``pinned_max_round_threshold_mb`` turns the rounding
off above a size, but then blocks of different sizes share a free list, and torch up to 2.13 hands a larger
request a smaller cached block (pytorch/pytorch#192722); the library leaves the setting alone. Instead a
storage's host copy is made of power-of-two pieces (:func:`host_pieces`: the binary digits of its size in
granules of at most 1/256 of it; 6.4 GiB: 4 + 2 + 0.25 + 0.125 + ... GiB), which the allocator takes as they
are (less than 0.4% over the bytes) and reuses from one layer and step to the next. :func:`pinned_bytes` is
what they take, ``pinned_on_host`` its sum; :func:`pow2_bytes` what a plain pinned block takes (FSDP2's
pinned shards). The dry run and the planner count these.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.multiprocessing.reductions import StorageWeakRef

OFFLOAD = ("none", "inputs", "all")


def pow2_bytes(nbytes: int) -> int:
    """Bytes the pinned host allocator takes for one block of ``nbytes``: the next power of two (0 for 0)."""
    n = int(nbytes)
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def host_pieces(nbytes: int) -> list[int]:
    """The power-of-two pieces (bytes, largest first) of a host copy of ``nbytes``: the binary digits of
    ``nbytes`` rounded up to a granule of at most ``nbytes / 256`` (at least 4 KiB, so every piece holds whole
    elements): at most 8 pieces, less than 0.4% (or 4 KiB) over."""
    n = int(nbytes)
    if n <= 0:
        return []
    granule = max(4096, 1 << max(0, n.bit_length() - 9))
    units = -(-n // granule)
    return [granule << i for i in range(units.bit_length() - 1, -1, -1) if units >> i & 1]


def pinned_bytes(nbytes: int) -> int:
    """Pinned host bytes of the library's host copy of a storage of ``nbytes`` (:func:`host_pieces`)."""
    return sum(host_pieces(nbytes))


def check_offload(mode: Any, name: str = "offload") -> None:
    """Raise ``ValueError`` naming ``name`` unless ``mode`` is one of :data:`OFFLOAD`."""
    if mode not in OFFLOAD:
        raise ValueError(f"{name} must be one of {OFFLOAD}, got {mode!r}")


@dataclass
class _HostCopy:
    """The host copy of one device storage: ``pieces`` (1-D, the storage's dtype, one after another; one
    piece on a CPU) and the event after which it is complete (CUDA) or ``None``."""

    pieces: list
    event: Optional[Any]
    source: StorageWeakRef


@dataclass(frozen=True)
class _Handle:
    """What a saved tensor became: its host copy and its view geometry on the original device."""

    copy: _HostCopy
    size: torch.Size
    stride: tuple
    offset: int
    device: torch.device

    def restore(self) -> torch.Tensor:
        pieces = self.copy.pieces
        if len(pieces) == 1:
            view = pieces[0].as_strided(self.size, self.stride, self.offset)
            if pieces[0].device == self.device:  # CPU: the copy is where the tensor was
                return view
        if self.copy.event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.copy.event)
        if len(pieces) == 1:
            return view.to(self.device, non_blocking=True)
        # the elements the view spans, gathered from the pieces they lie in
        lo = self.offset
        hi = lo + (1 + sum((n - 1) * st for n, st in zip(self.size, self.stride)) if all(self.size) else 0)
        out = torch.empty(hi - lo, dtype=pieces[0].dtype, device=self.device)
        start = 0
        for piece in pieces:
            a, b = max(lo, start), min(hi, start + piece.numel())
            if a < b:
                out[a - lo:b - lo].copy_(piece[a - start:b - start], non_blocking=True)
            start += piece.numel()
        return out.as_strided(self.size, self.stride, 0)


class HostOffload:
    """Saved-tensor hooks of one forward that keep the selected tensors in host memory.

    ``with off.hooks(): ...`` around the forward; :meth:`mark` the layer inputs before they are
    saved. ``bytes_on_host`` counts the storage bytes copied (CUDA, or CPU with ``copy_on_cpu``).
    ``pinned_on_host`` the same copies as the pinned allocator holds them (:func:`pinned_bytes`).
    ``host``: where the copies of CPU tensors go, for CPU tensors that stand for a device's
    (``burstattn train --dry-run``'s fake tensors: ``meta``, a device the dry run's tracker does not
    count as the GPU's, so the saved tensors leave the device as on a GPU and come back when
    unpacked). Instance state only: make one per forward.
    """

    def __init__(self, mode: str, *, copy_on_cpu: bool = False, host: Optional[torch.device] = None) -> None:
        check_offload(mode)
        self.mode, self.copy_on_cpu, self.host = mode, copy_on_cpu, host
        self._copies: dict[tuple, _HostCopy] = {}
        self._marked: list[StorageWeakRef] = []
        self._stream = None
        self.bytes_on_host = 0
        self.pinned_on_host = 0  # the same copies as pinned blocks (pinned_bytes): what a GPU's host holds

    @property
    def active(self) -> bool:
        return self.mode != "none"

    def mark(self, t: torch.Tensor) -> torch.Tensor:
        """Mark ``t``'s storage as a layer input (offloaded with ``"inputs"`` and ``"all"``); returns ``t``."""
        if self.active and isinstance(t, torch.Tensor):
            self._marked.append(StorageWeakRef(t.untyped_storage()))
        return t

    def hooks(self):
        """The ``saved_tensors_hooks`` context of this offload (a no-op context when ``"none"``)."""
        if not self.active:
            import contextlib
            return contextlib.nullcontext()
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def wants(self, t: torch.Tensor) -> bool:
        """Whether a saved ``t`` goes to host memory: floating-point activations only (never a
        parameter or a view of one, an index tensor or a tensor subclass); CPU tensors only with
        ``copy_on_cpu``."""
        plain = type(t) is torch.Tensor or isinstance(t, FakeTensor)  # a fake tensor stands for a plain one
        if not self.active or not plain or t.layout != torch.strided or not t.is_floating_point():
            return False
        if t.device.type == "cpu" and not (self.copy_on_cpu or self.host is not None):
            return False
        base = t._base if t._base is not None else t
        if base.is_leaf and base.requires_grad:  # a weight the backward reads (it stays where it is)
            return False
        if self.mode == "all":
            return True
        ref = StorageWeakRef(t.untyped_storage())
        self._marked = [m for m in self._marked if not m.expired()]
        return any(m == ref for m in self._marked)

    def pack(self, t: torch.Tensor) -> Any:
        """The saved-tensor pack hook: ``t`` itself, or a handle to its host copy."""
        if not self.wants(t):
            return t
        storage = t.untyped_storage()
        key = (t.device, StorageWeakRef(storage).cdata, storage.nbytes())  # the storage itself (a fake one has no data)
        copy = self._copies.get(key)
        if copy is None or copy.source.expired():  # a new storage (perhaps at a freed one's address)
            copy = self._copy_to_host(t, storage)
            self._copies[key] = copy
        return _Handle(copy, t.size(), t.stride(), t.storage_offset(), t.device)

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        """The saved-tensor unpack hook."""
        return packed.restore() if isinstance(packed, _Handle) else packed

    def _copy_to_host(self, t: torch.Tensor, storage) -> _HostCopy:
        self.bytes_on_host += storage.nbytes()
        e = t.element_size()
        if t.device.type == "cpu" and self.host is not None:  # no data to copy (the host is meta); a
            # whole-storage view (``set_``) of a fake tensor would keep its storage alive in the fake mode
            self.pinned_on_host += pinned_bytes(storage.nbytes())
            pieces = [torch.empty(n // e, dtype=t.dtype, device=self.host) for n in host_pieces(storage.nbytes())]
            return _HostCopy(pieces, None, StorageWeakRef(storage))
        whole = t.new_empty(0).set_(storage)  # 1-D over the whole storage, t's dtype
        if t.device.type == "cpu":
            return _HostCopy([whole.clone()], None, StorageWeakRef(storage))
        self.pinned_on_host += pinned_bytes(storage.nbytes())
        if self._stream is None:
            self._stream = torch.cuda.Stream(t.device)
        self._stream.wait_stream(torch.cuda.current_stream(t.device))
        pieces, start = [], 0
        with torch.cuda.stream(self._stream):
            for n in host_pieces(storage.nbytes()):  # power-of-two blocks: the pinned allocator rounds none up
                piece = torch.empty(n // e, dtype=whole.dtype, pin_memory=True)
                m = min(piece.numel(), whole.numel() - start)
                piece[:m].copy_(whole[start:start + m], non_blocking=True)
                pieces.append(piece)
                start += m
            event = self._stream.record_event()
        whole.record_stream(self._stream)  # the device block stays allocated until the copy is done
        return _HostCopy(pieces, event, StorageWeakRef(storage))


def offload_problem(mode: str, needed_bytes: float, available_bytes: float, flag: str = "--offload") -> Optional[str]:
    """Why ``mode`` cannot run when it needs ``needed_bytes`` of host memory per process and
    ``available_bytes`` are available (``None`` if it can)."""
    if mode == "none" or needed_bytes <= available_bytes:
        return None
    return (f"{flag} {mode} needs about {needed_bytes / 2**30:.2f} GiB of host memory per process for the saved "
            f"activations, but only {available_bytes / 2**30:.2f} GiB are available (MemAvailable shared by "
            f"this host's ranks); use a shorter --seq-len, --offload inputs, or --offload none")


def optimizer_offload_problem(state_bytes: float, activation_bytes: float, available_bytes: float) -> Optional[str]:
    """Why ``--offload-optimizer`` cannot run when one process's float32 parameter shard, gradients and
    AdamW state (``state_bytes``) plus its offloaded activations exceed ``available_bytes`` (``None`` if not)."""
    if state_bytes + activation_bytes <= available_bytes:
        return None
    acts = f" plus {activation_bytes / 2**30:.2f} GiB of --offload activations" if activation_bytes else ""
    return (f"--offload-optimizer needs about {state_bytes / 2**30:.2f} GiB of host memory per process (the float32 "
            f"parameters, gradients and AdamW state of its shard){acts}, but only {available_bytes / 2**30:.2f} GiB "
            f"are available (MemAvailable shared by this host's ranks); shard over more ranks (--dp, --cp) or drop "
            f"--offload-optimizer")


def offloaded_bytes(config, *, batch: int, rows: int, attn_rows: int, heads: int, checkpointing: str, mode: str,
                    element_size: int) -> float:
    """Host bytes one process holds at the end of a forward with ``offload=mode``: every layer's
    input and the final hidden state (``batch x rows x dim``), and with ``"all"`` what each layer keeps
    beyond its input: the attention output and LSE (``batch x attn_rows x heads``) under ``remat``, an
    upper bound of every activation (``10 dim + 4 ffn_dim`` per row) under ``none``. ``heads``: this
    process's query heads (``n_heads / tp``)."""
    if mode == "none":
        return 0.0
    e, layers = element_size, config.n_layers
    total = (layers + 1) * batch * rows * config.dim * e
    if mode == "all" and checkpointing == "remat":
        total += layers * batch * attn_rows * heads * (config.head_dim * e + 4)
    elif mode == "all" and checkpointing == "none":
        total += layers * batch * rows * (10 * config.dim + 4 * config.ffn_dim) * e
    return float(total)

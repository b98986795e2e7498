"""The device-aware kernel policy: how one ring step computes, as a pure function of the device type the
step runs (or is modelled) on, the dtype, the backend, the mask's kind and ``grad_partials``.

On CUDA a 16-bit step is one kernel forward and one kernel backward per block pair and head group, in
the inputs' own dtype; the engine accumulates the partial outputs and gradients in float32 (as
ring-flash-attention does). A pair that carries a mask goes to ONE call of a kernel that applies the
mask itself: packed documents and sliding windows through PyTorch's own flash kernels (varlen
``cum_seq_q/k``, ``window_size_left/right``), float32 documents through the memory-efficient kernel
(``cu_seqlens``), ``mask_mod`` and mixed masks through FlexAttention. On the CPU the engine keeps its
block ops: partial tiles with explicit masks and, for 16-bit inputs, float32 gradient tiles (the CPU
flash kernel's 16-bit partials need them).

``grad_partials``: ``"auto"`` (the default) is ``"kernel"`` on CUDA and ``"float32"`` elsewhere; the two
explicit values keep their meaning (``"float32"``: every 16-bit gradient partial is computed on float32
copies of one tile at a time; ``"kernel"``: the kernel's own output dtype).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

GRAD_PARTIALS = ("auto", "float32", "kernel")
MASK_KINDS = ("none", "window", "documents", "documents+window", "mask_mod", "mixed")
"""A mask's kind (:attr:`burstattn.AttnMask.kind`): no mask beyond causal; a sliding window; packed
documents; both; a ``mask_mod`` alone; a ``mask_mod`` with a window or documents."""
STEPS = ("pair", "tiles")
MASKED_PATHS = ("dense", "varlen", "window", "flex", "tiles")
LOW_PRECISION = (torch.float16, torch.bfloat16)
GPU_BACKENDS = ("sdpa", "flash_attn", "cpu_flash")  # cpu_flash: the stand-in of a CUDA kernel in a modelled step
PAIR_NEEDS = frozenset({"softcap", "alibi", "v_head_dim", "deterministic"})
"""What the one-call masked kernels do not take (those calls keep the engine's tiles)."""


@dataclass(frozen=True)
class KernelPolicy:
    """How a step computes (see the module docstring).

    Attributes:
        device_type: the device type the step runs (or is modelled) on; ``"cuda"`` or anything else (the
            CPU rule).
        grad_partials: ``"float32"`` or ``"kernel"`` (``"auto"`` resolved).
        step: ``"pair"``: every non-empty block pair is one kernel forward and one kernel backward per head
            group, in the inputs' dtype; ``"tiles"``: the engine's block ops (partial tiles with explicit
            masks, float32 gradient tiles when ``grad_partials == "float32"`` and the inputs are 16-bit).
        masked: the path of a masked pair: ``"dense"`` (no mask: the kernel's own causal mode),
            ``"varlen"`` (documents: ``cum_seq_q/k``, with a window where there is one), ``"window"``
            (``window_size_left/right``), ``"flex"`` (FlexAttention with a block mask) or ``"tiles"``.
        kernel: what runs a masked pair: ``"aten_flash"`` (``torch.ops.aten._flash_attention_forward`` /
            ``_backward``), ``"aten_efficient"`` (``_efficient_attention_forward`` / ``_backward``),
            ``"flash_attn"`` (the package's varlen functions), ``"flex"``, or the backend's own name
            (dense pairs and tiles).
        compute_dtype: the dtype the kernel runs in (the inputs'; float32 for 16-bit float32 tiles).
    """

    device_type: str
    grad_partials: str
    step: str
    masked: str
    kernel: str
    compute_dtype: torch.dtype

    @property
    def one_call(self) -> bool:
        """Whether a masked pair is one kernel call (not the engine's tiles)."""
        return self.masked in ("varlen", "window", "flex")


def resolve_grad_partials(device_type: str, grad_partials: str = "auto") -> str:
    """``"auto"`` -> ``"kernel"`` on CUDA, ``"float32"`` elsewhere; the explicit values unchanged.
    Raises ``ValueError`` for another value."""
    if grad_partials not in GRAD_PARTIALS:
        raise ValueError(f"grad_partials must be one of {GRAD_PARTIALS}, got {grad_partials!r}")
    if grad_partials != "auto":
        return grad_partials
    return "kernel" if device_type == "cuda" else "float32"


def _masked(dtype: torch.dtype, backend: str, mask_kind: str) -> tuple[str, str]:
    """``(masked path, kernel)`` of a CUDA step that runs pairs in one call."""
    if mask_kind == "none":
        return "dense", backend
    if mask_kind in ("mask_mod", "mixed"):
        return "flex", "flex"
    if dtype in LOW_PRECISION:
        kernel = "flash_attn" if backend == "flash_attn" else "aten_flash"
        return ("window" if mask_kind == "window" else "varlen"), kernel
    if mask_kind == "documents":  # float32: the memory-efficient kernel takes cu_seqlens, not two-sided windows
        return "varlen", "aten_efficient"
    return "flex", "flex"  # float32 windows: FlexAttention takes them as a mask


def kernel_policy(device_type: str, dtype: torch.dtype, backend: str, mask_kind: str,
                  grad_partials: str = "auto", needs: frozenset = frozenset()) -> KernelPolicy:
    """The :class:`KernelPolicy` of a step (pure).

    Args:
        device_type: the device type the step runs on, or is modelled on (a dry run states ``"cuda"`` for
            fake CPU tensors); ``"cuda"``: the GPU rule, anything else the CPU rule.
        dtype: the inputs' dtype. float64 always runs the engine's tiles (the reference kernel).
        backend: the resolved local backend (``"reference"`` runs tiles everywhere).
        mask_kind: one of :data:`MASK_KINDS`.
        grad_partials: ``"auto"``, ``"float32"`` or ``"kernel"``.
        needs: what the call asks of its kernel beyond attention (``burstattn.kernels.NEEDS``: softcap,
            ALiBi, a V head size of its own, deterministic); a masked pair that needs any of them keeps
            the tiles (the one-call kernels take none).
    Raises:
        ValueError: an unknown ``grad_partials`` or ``mask_kind``.
    """
    if mask_kind not in MASK_KINDS:
        raise ValueError(f"mask_kind must be one of {MASK_KINDS}, got {mask_kind!r}")
    resolved = resolve_grad_partials(device_type, grad_partials)
    tiles_dtype = torch.float32 if dtype in LOW_PRECISION and resolved == "float32" else dtype
    gpu = device_type == "cuda" and dtype != torch.float64 and backend in GPU_BACKENDS
    if not gpu:
        masked = "dense" if mask_kind == "none" else "tiles"
        return KernelPolicy(device_type, resolved, "tiles", masked, backend, tiles_dtype)
    masked, kernel = _masked(dtype, backend, mask_kind)
    if masked != "dense" and frozenset(needs) & PAIR_NEEDS:
        masked, kernel = "tiles", backend
    step = "pair" if resolved == "kernel" or dtype not in LOW_PRECISION else "tiles"
    if step == "tiles":  # grad_partials="float32" asked for on a GPU: the float32 tiles, masks as tiles
        masked, kernel = ("dense" if mask_kind == "none" else "tiles"), backend
    return KernelPolicy(device_type, resolved, step, masked, kernel, dtype if step == "pair" else tiles_dtype)

"""What a GPU attention kernel allocates beside its inputs and outputs, per backend (pure; bytes).

The dry run (``burstattn train --dry-run``) runs the CPU flash op on fake tensors in place of the GPU's
kernel: it allocates the same outputs (output and LSE forward; dQ, dK, dV backward, K/V at their own
heads), and :func:`kernel_workspace` adds what the GPU kernel allocates besides, at each call. The
planner's memory model (``burstattn.sim.memory``) counts the same function, so the two agree by
construction on this term.

* ``flash_attn`` (flash-attn 2, ``csrc/flash_attn/flash_api.cpp: mha_bwd``) and ``sdpa`` (PyTorch's own
  flash kernel is the same code; its cuDNN kernel's workspace is not published and is counted as
  flash's): the backward's float32 ``dq_accum [B, n_q', Hq, d']`` and ``softmax_d [B, Hq, n_q']``
  (``n_q'`` rounded up to 128 rows, ``d'`` to 32), and with grouped K/V heads (GQA) the expanded
  ``dk_expanded``, ``dv_expanded [B, n_k, Hq, d]`` in the inputs' dtype, summed to the K/V heads at the
  end. The forward allocates nothing beside its outputs.
* ``sdpa`` also copies the inputs that are neither contiguous nor a ``[B, S, H, D]`` tensor seen as
  ``[B, H, S, D]`` (``kernels.sdpa.dense``: row slices of a head group's block, which the fused kernels
  misread): ``copied`` bytes, computed by the caller from the call's tensors.
* float32 (SDPA's memory-efficient kernel, which expands grouped K/V heads): not counted; a GPU trains
  in 16 bits.
"""
from __future__ import annotations

GPU_BACKENDS = ("sdpa", "flash_attn")
"""The CUDA backends a dry run and the planner model (:func:`kernel_workspace`)."""


def _up(x: int, m: int) -> int:
    return -(-int(x) // m) * m


def flash_backward_workspace(*, batch: int, q_heads: int, kv_heads: int, q_rows: int, k_rows: int, head_dim: int,
                             element_size: int) -> int:
    """Bytes flash-attn 2's backward allocates beside dQ, dK, dV for ``q [B, q_rows, Hq, d]``,
    ``k, v [B, k_rows, Hkv, d]``: ``dq_accum`` and ``softmax_d`` (float32), and ``dk_expanded`` /
    ``dv_expanded`` when ``kv_heads < q_heads``."""
    rows = _up(q_rows, 128)
    accum = batch * rows * q_heads * (_up(head_dim, 32) if head_dim <= 192 else 256) * 4 + batch * q_heads * rows * 4
    expanded = 2 * batch * k_rows * q_heads * head_dim * element_size if kv_heads < q_heads else 0
    return int(accum + expanded)


def kernel_workspace(backend: str, *, batch: int, q_heads: int, kv_heads: int, q_rows: int, k_rows: int,
                     head_dim: int, element_size: int, backward: bool, copied: int = 0) -> int:
    """Bytes one call of ``backend``'s GPU kernel allocates beside its inputs and outputs (module
    docstring); ``copied``: the bytes of the call's inputs that ``sdpa`` copies (0 for ``flash_attn``).
    Raises ``ValueError`` for a backend not in :data:`GPU_BACKENDS`."""
    if backend not in GPU_BACKENDS:
        raise ValueError(f"kernel_workspace: backend must be one of {GPU_BACKENDS}, got {backend!r}")
    if element_size >= 4:
        return 0
    ws = flash_backward_workspace(batch=batch, q_heads=q_heads, kv_heads=kv_heads, q_rows=q_rows, k_rows=k_rows,
                                  head_dim=head_dim, element_size=element_size) if backward else 0
    return ws + (int(copied) if backend == "sdpa" else 0)

"""Optimizer and parameter offload (FSDP2's ``CPUOffloadPolicy``, ``burstattn train --offload-optimizer``) in
the simulator: what stays on the device, what the host holds, the host-link traffic and the CPU
optimizer step's time (pure).

With the policy, each rank's parameter shard (float32 master weights), its gradient shard and AdamW's
two moments live in host memory: ``16 bytes x parameters / shards`` per device (the ZeRO paper's 16
bytes per parameter, all on the host; ZeRO-Offload, Ren et al. 2021). The device holds only what FSDP
gathers for the blocks computing (two blocks and the root unit, as without offload) and the unsharded
gradients of the block differentiating (two blocks) before their reduce-scatter; no optimizer state,
no float32 temporary of the optimizer step.

Host link per step (one device, per direction): the float32 shard copied to the device before each
all-gather (forward and, with resharding, backward) and the reduced gradient shard copied back
(backward, the other direction): ``4 x parameters / shards`` bytes each way and phase.

CPU optimizer step: PyTorch's AdamW reads the parameter, gradient and two moments and writes the
parameter and moments, all float32: :data:`ADAM_BYTES` = 28 bytes per parameter through host memory,
at the cluster's ``host_adam_bw`` (bytes/s per device; its source is in the preset). It runs after
the backward: nothing hides it.
"""
from __future__ import annotations

from ..models.config import LlamaConfig

HOST_STATE_BYTES = 16  # float32 master weights, gradients, exp_avg, exp_avg_sq
ADAM_BYTES = 28  # read param, grad, exp_avg, exp_avg_sq; write param, exp_avg, exp_avg_sq (float32)


def parameter_shapes(model: LlamaConfig, tp: int) -> list[tuple[int, int]]:
    """``(rows, columns)`` of every parameter on one tp rank (Megatron's column and row splits; norms whole):
    FSDP2 shards each over its rows."""
    h, f, v, d = model.dim, model.ffn_dim, model.vocab_size, model.head_dim
    q, kv = model.n_heads * d // tp, max(1, model.n_kv_heads // tp) * d
    layer = [(q, h), (kv, h), (kv, h), (h, q), (f // tp, h), (h, f // tp), (f // tp, h), (h, 1), (h, 1)]
    return [(v, h // tp)] + layer * model.n_layers + [(h, 1)] + ([] if model.tie_embeddings else [(v // tp, h)])


def pinned_state_bytes(model: LlamaConfig, *, tp: int, shards: int) -> float:
    """Host bytes of the offloaded state as FSDP2's ``CPUOffloadPolicy(pin_memory=True)`` allocates them: each
    parameter's float32 shard (padded to whole rows) and its gradient pinned, each a power-of-two block
    (``models.offload.pow2_bytes``); AdamW's two moments plain host memory (exact)."""
    from ..models.offload import pow2_bytes

    total = 0.0
    for rows, cols in parameter_shapes(model, tp):
        shard = -(-rows // shards) * cols * 4
        total += 2 * pow2_bytes(shard) + 2 * rows * cols * 4 / shards
    return total


def offloaded_state(model: LlamaConfig, *, tp: int, shards: int, e: int, gathered: float) -> tuple[float, float, float, float]:
    """``(device params, device grads, device optimizer state, host bytes)`` of one device with the
    optimizer offloaded; ``gathered``: what FSDP all-gathers (``memory.gathered_bytes``). The host bytes are
    the exact state (:data:`HOST_STATE_BYTES` per parameter); :func:`pinned_state_bytes` as pinned."""
    n = model.num_params() / tp
    layer = n / model.n_layers
    return gathered, 2 * layer * e, 0.0, HOST_STATE_BYTES * n / shards


def host_link_bytes(model: LlamaConfig, *, tp: int, shards: int) -> tuple[float, float]:
    """``(forward, backward)`` bytes over one device's host link (the larger direction per phase)."""
    shard = 4 * model.num_params() / tp / shards
    return shard, shard


def cpu_step_seconds(model: LlamaConfig, *, tp: int, shards: int, host_adam_bw: float) -> float:
    """Seconds of AdamW on the host over this device's parameter shard."""
    return ADAM_BYTES * model.num_params() / tp / shards / host_adam_bw


def offload_problem(need: float, available: float, flag: str = "--offload-optimizer") -> str | None:
    """A message naming ``flag`` when ``need`` bytes of host memory per device exceed ``available``."""
    if need <= available:
        return None
    return (f"{flag}: the host would hold {need / 2**30:.1f} GiB per device (float32 parameters, gradients and "
            f"AdamW state of this rank's shard) but {available / 2**30:.1f} GiB is available; use more ranks "
            f"to shard over, or drop {flag}")

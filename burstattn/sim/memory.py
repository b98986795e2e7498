"""Per-device memory: parameters, gradients and optimizer state (with or without ZeRO-3 / FSDP),
activations per checkpointing mode, the attention call's buffers and the KV cache (pure).

Training keeps mixed-precision Adam state: 16-bit weights and gradients (2 + 2 bytes per
parameter), float32 master weights and two float32 moments (12 bytes): 16 bytes per parameter
(the ZeRO paper's count). FSDP / ZeRO-3 shards all of it over the data-parallel ranks (``dp * cp``:
context-parallel ranks hold the same weights) and gathers two layers at a time (the one computing
and the one prefetched). Tensor parallelism divides the weights by ``tp``.

Activations saved per layer and token (elements; ``h`` hidden, ``kvd = Hkv*head_dim``, ``f`` MLP):
inside the tensor-parallel region (divided by ``tp``) q, k, v (``h + 2 kvd``), the attention output
(``h``) and the MLP's ``w1``/``w3`` outputs, SiLU and product (``4 f``), plus the float32 LSE; outside
it (divided by ``tp`` only with sequence parallelism, Megatron-V3) the two norms' inputs and
outputs (``4 h``). Checkpointing ``full`` keeps only each layer's input and rebuilds one layer at a
time in the backward; ``remat`` (DistFlashAttn's rematerialization-aware checkpointing) also keeps
the attention output and LSE, so the backward never reruns the attention forward. The logits
(16-bit, plus float32 for the loss) of the local tokens are counted once.

The attention call's own buffers follow the strategies' code (``[B, H, n, D]`` tensors of the
local shard, ``e`` input bytes, ``a = 4`` accumulator bytes): see :func:`attention_buffers`.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..models.config import LlamaConfig


@dataclass(frozen=True)
class Memory:
    """Bytes per device, by part, and whether the sum fits."""

    params: float
    grads: float
    optimizer: float
    activations: float
    attention: float
    kv_cache: float
    capacity: float

    @property
    def peak(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.attention + self.kv_cache

    @property
    def fits(self) -> bool:
        return self.peak <= self.capacity

    def to_dict(self) -> dict:
        return {k: int(getattr(self, k)) for k in ("params", "grads", "optimizer", "activations", "attention",
                                                  "kv_cache")}


def attention_buffers(strategy: str, *, batch: int, local_seq: int, world: int, q_heads: int, kv_heads: int,
                      head_dim: int, e: int, backward: bool, schedule: str = "ring", bwd_mode: str = "burst",
                      ulysses: int = 1) -> float:
    """Peak bytes one attention call allocates on one device beyond its saved inputs (q, k, v, out,
    LSE and dO belong to the activations): travelling double buffers, float32 accumulators, gathered
    copies. ``q_heads``/``kv_heads`` are this tp rank's."""
    n, d, a = local_seq, head_dim, 4
    qn, kvn = batch * n * q_heads * d, batch * n * kv_heads * d  # elements of one local q / k shard
    big = world * n
    if strategy in ("burst", "ring", "usp"):
        fwd = 2 * (2 * kvn * e) + qn * a + 2 * qn * e  # kv double buffer, float32 out, block out + cast
        if not backward:
            return fwd
        if bwd_mode == "kv":
            bwd = 2 * (2 * kvn * e) + 2 * (2 * kvn * a) + qn * a + 2 * qn * e  # kv x2, dkv acc x2, dq, block grads
        else:
            pack = batch * n * q_heads * (2 * d * e + 2 * a)
            bwd = 2 * pack + 2 * qn * a + 2 * kvn * a + 2 * qn * e
        if strategy == "usp":
            bwd += 2 * (qn + 2 * kvn) * e
        return max(fwd, bwd)
    if strategy == "rsa":
        scores = batch * q_heads * n * big * a
        return scores * (3 if backward else 2) + 2 * 2 * kvn * e
    if strategy == "allgather":
        full_kv = 2 * kvn * world * e
        return full_kv + qn * a + (2 * kvn * world * a if backward else 0)
    if strategy in ("ulysses", "tp", "tp-v1", "tp-v3"):
        heads_q = q_heads // world if strategy in ("ulysses", "tp") else q_heads
        heads_kv = max(1, kv_heads // world) if strategy in ("ulysses", "tp") else kv_heads
        rows = big if strategy in ("ulysses", "tp") else n
        gathered = batch * rows * (heads_q + 2 * heads_kv) * d * e
        out = batch * rows * heads_q * d * (a + e)
        return gathered + out + (gathered * a // e + out if backward else 0)
    raise ValueError(f"no memory model for strategy {strategy!r}")


def activation_bytes(model: LlamaConfig, *, tokens: int, tp: int, sp: bool, checkpointing: str, e: int) -> float:
    """Saved activations of all layers on one device (``tokens`` local tokens)."""
    h, f = model.dim, model.ffn_dim
    kvd = model.n_kv_heads * model.head_dim
    inside = (h + 2 * kvd) + h + 4 * f
    outside = 4 * h
    lse = model.n_heads * 4 / tp  # float32, bytes
    per_layer = tokens * ((inside / tp + outside / (tp if sp else 1)) * e + lse)
    layer_input = tokens * h * e / (tp if sp else 1)
    logits = tokens * model.vocab_size / tp * (e + 4)
    if checkpointing == "none":
        return model.n_layers * per_layer + logits
    if checkpointing == "full":
        return model.n_layers * layer_input + per_layer + logits
    if checkpointing == "remat":
        kept = layer_input + tokens * (h / tp * e + lse)
        return model.n_layers * kept + per_layer + logits
    raise ValueError(f"checkpointing must be none, full or remat, got {checkpointing!r}")


def state_bytes(model: LlamaConfig, *, tp: int, shards: int, fsdp: bool, train: bool, e: int) -> tuple[float, float, float]:
    """``(params, grads, optimizer)`` bytes on one device (``shards`` = dp * cp ranks)."""
    n = model.num_params() / tp
    if not train:
        return n * e, 0.0, 0.0
    if not fsdp:
        return n * e, n * e, n * 12
    layer = n / model.n_layers
    return n * e / shards + 2 * layer * e, n * e / shards + 2 * layer * e, n * 12 / shards


def kv_cache_bytes(model: LlamaConfig, *, batch: int, tokens: int, tp: int, e: int) -> float:
    """K and V of ``tokens`` local cached tokens, every layer (kv heads split by tp, at least one)."""
    kv_heads = max(1, model.n_kv_heads // tp)
    return 2 * model.n_layers * batch * tokens * kv_heads * model.head_dim * e

"""transformers' hybrid mixers made sequence parallel: which ones (the table), and their sequence
computation over this rank's shard of the tokens (the adapters). :mod:`.hybrid` patches a model with them.

**The table** (by class name, checked against transformers 5.24): :data:`SUPPORTED` maps each class
burstattn makes sequence parallel to ``(model_type, recurrence)``, the recurrence one of
:mod:`burstattn.recurrent`'s: ``"gdn"`` (Gated DeltaNet: conv + gated delta rule), ``"kda"`` (Kimi delta
attention: conv + per-channel decay), ``"ssd"`` (Mamba2: conv + state-space duality scan),
``"lightning"`` (MiniMax's constant-decay linear attention), ``"conv"`` (LFM2's gated short convolution);
:data:`REFUSED` says why the known others stay refused (:func:`hint`, read by :func:`burstattn.hf.check_model`).

**The adapters** (:data:`ADAPTERS`, one function per recurrence): each reads the module's own projections
and norms (so a checkpoint's weights are used as they are) and replaces only what mixes the sequence,
through ``ops``:

* :class:`ShardedOps` (a :func:`burstattn.hf.shard_batch` batch): the causal convolution by
  :func:`burstattn.recurrent.sp_causal_conv1d` (the halo from the ranks before) and the chunked recurrence
  by its state-passing form, over the batch's group, layout and documents;
* :class:`CachedOps` (generation over a :class:`burstattn.hf.ShardedCache`: every rank runs the same
  tokens): the local chunked forms continuing from the conv window and recurrent state kept in the cache
  (replicated on every rank: a constant size per layer, while the attention's K/V stay sharded).

Shapes: ``hidden_states [rows, n, hidden]`` (``n`` this rank's tokens per row) in, ``[rows, n, hidden]``
out, as the transformers forward they replace (checked against transformers 5.24's torch fallbacks: same
math, same dtypes).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import accum_dtype
from ..recurrent import (chunk_delta_rule, chunk_linear_attention, sp_causal_conv1d, sp_gated_delta_rule, sp_kda,
                         sp_lightning_attention, sp_ssd)

PATCHED = "_burstattn_sequence_parallel"  # on a patched module instance: its recurrence ("gdn", "ssd", ...)

SUPPORTED = {
    "Qwen3NextGatedDeltaNet": ("qwen3_next", "gdn"),
    "Qwen3_5GatedDeltaNet": ("qwen3_5", "gdn"),
    "Qwen3_5MoeGatedDeltaNet": ("qwen3_5_moe", "gdn"),
    "OlmoHybridGatedDeltaNet": ("olmo_hybrid", "gdn"),
    "KimiLinearDeltaAttention": ("kimi_linear", "kda"),
    "BambaMixer": ("bamba", "ssd"),
    "GraniteMoeHybridMambaLayer": ("granitemoehybrid", "ssd"),
    "NemotronHMamba2Mixer": ("nemotron_h", "ssd"),
    "FalconH1Mixer": ("falcon_h1", "ssd"),
    "MiniMaxLightningAttention": ("minimax", "lightning"),
    "Lfm2ShortConv": ("lfm2", "conv"),
    "Lfm2MoeShortConv": ("lfm2_moe", "conv"),
}

# known mixers that stay refused, with the reason (a class in neither table is refused as unclassified)
REFUSED = {
    "JambaMambaMixer": "Mamba (v1)'s selective scan decays every (channel, state) pair on its own: not a scalar "
                       "or per-key-channel decay that burstattn.recurrent passes between ranks",
    "MambaMixer": "Mamba (v1)'s selective scan (a decay per channel and state)",
    "FalconMambaMixer": "Mamba (v1)'s selective scan (a decay per channel and state)",
    "Zamba2MambaMixer": "Zamba2's Mamba2 mixer is not yet adapted (its layers share blocks)",
    "Mamba2Mixer": "pure Mamba2 models have no attention layer to shard with burstattn",
    "RecurrentGemmaRecurrentBlock": "RG-LRU (a per-channel gated recurrence) is not yet adapted",
    "RecurrentGemmaRglru": "RG-LRU (a per-channel gated recurrence) is not yet adapted",
}


def hint(class_name: str) -> str:
    """What to do about one refused mixer class: patch it, or why it stays refused ('' if unknown)."""
    if class_name in SUPPORTED:
        return f"{class_name} is sequence parallel after burstattn.hf.patch_mixers(model)"
    if class_name in REFUSED:
        return f"{class_name}: {REFUSED[class_name]}"
    return ""


class ShardedOps:
    """The sequence mixing of a sharded batch: ``sp`` = ``group``, ``layout``, ``cu_seqlens``."""

    def __init__(self, sp: dict) -> None:
        self.sp = sp

    def conv(self, x, conv, activation=None):
        return sp_causal_conv1d(x, conv.weight, conv.bias, activation=activation, **self.sp)

    def delta(self, q, k, v, g, beta):
        fn = sp_kda if g.dim() == 4 else sp_gated_delta_rule
        return fn(q, k, v, g, beta, use_qk_l2norm=True, **self.sp)[0]

    def ssd(self, x, dt, A, B, C, D):
        return sp_ssd(x, dt, A, B, C, D=D, **self.sp)[0]

    def lightning(self, q, k, v, slope):
        return sp_lightning_attention(q, k, v, slope, **self.sp)[0]


class CachedOps:
    """The sequence mixing of one generation step (or prompt) on every rank alike, continuing from the
    ``slot`` dict of this layer in the cache (``"conv"``: the last ``K - 1`` inputs ``[B, K-1, C]``,
    ``"state"``: ``[B, H, dk, dv]``), which it updates."""

    def __init__(self, slot: dict) -> None:
        self.slot = slot

    def conv(self, x, conv, activation=None):
        B, n, C = x.shape
        w = conv.weight.reshape(C, -1)  # [C, K]
        prev = self.slot.get("conv")
        prev = x.new_zeros(B, w.shape[1] - 1, C) if prev is None else prev
        full = torch.cat([prev, x], dim=1)  # [B, K-1+n, C]
        self.slot["conv"] = full[:, full.shape[1] - (w.shape[1] - 1):].detach()
        y = F.conv1d(full.transpose(1, 2).to(w.dtype), w.unsqueeze(1), conv.bias, groups=C).transpose(1, 2)
        return (F.silu(y) if activation in ("silu", "swish") else y).to(x.dtype)

    def _run(self, fn, q, k, v, *rest, **kw):
        dtype, up = q.dtype, accum_dtype(q.dtype)
        rep = v.shape[2] // k.shape[2]
        q, k = (t.repeat_interleave(rep, dim=2) if rep > 1 else t for t in (q, k))
        o, self.slot["state"] = fn(*(t.to(up) for t in (q, k, v, *rest)), initial_state=self.slot.get("state"), **kw)
        self.slot["state"] = self.slot["state"].detach()
        return o.to(dtype)

    def delta(self, q, k, v, g, beta):
        return self._run(chunk_delta_rule, q, k, v, g, beta, use_qk_l2norm=True)

    def ssd(self, x, dt, A, B, C, D):
        rep = x.shape[2] // B.shape[2]
        B, C = (t.repeat_interleave(rep, dim=2) if rep > 1 else t for t in (B, C))
        y = self._run(chunk_linear_attention, C, B * dt.unsqueeze(-1), x, dt * A.to(dt.dtype))
        return y + x * D.to(x.dtype).view(1, 1, -1, 1)

    def lightning(self, q, k, v, slope):
        g = (-slope).to(q.dtype).view(1, 1, -1).expand(q.shape[0], q.shape[1], -1)
        return self._run(chunk_linear_attention, q, k, v, g)


def _masked(x: torch.Tensor, attention_mask) -> torch.Tensor:
    """transformers' ``apply_mask_to_padding_states`` (a 2-D mask zeroes pad positions; position-wise)."""
    return x if attention_mask is None else (x * attention_mask[:, :, None]).to(x.dtype)


def _conv(m, x: torch.Tensor, ops, activation=None) -> torch.Tensor:
    return ops.conv(x, m.conv1d if hasattr(m, "conv1d") else m.conv, activation)


def gated_deltanet(m, hidden_states: torch.Tensor, attention_mask, ops) -> torch.Tensor:
    """Gated DeltaNet: Qwen3-Next (fused qkvz/ba projections), Qwen3.5 (separate ones), OLMo hybrid
    (q/k/v/a/b/g projections, optional negative eigenvalues)."""
    hs = _masked(hidden_states, attention_mask)
    B, n, _ = hs.shape
    if hasattr(m, "in_proj_qkvz"):  # Qwen3-Next: heads interleaved in one projection
        q, k, v, z, b, a = m.fix_query_key_value_ordering(m.in_proj_qkvz(hs), m.in_proj_ba(hs))
        mixed = torch.cat([x.reshape(B, n, -1) for x in (q, k, v)], dim=-1)
    elif hasattr(m, "in_proj_qkv"):  # Qwen3.5
        mixed, z, b, a = m.in_proj_qkv(hs), m.in_proj_z(hs), m.in_proj_b(hs), m.in_proj_a(hs)
    else:  # OLMo hybrid
        mixed = torch.cat([m.q_proj(hs), m.k_proj(hs), m.v_proj(hs)], dim=-1)
        z, b, a = m.g_proj(hs), m.b_proj(hs), m.a_proj(hs)
    mixed = _conv(m, mixed, ops, m.activation)  # [B, n, 2 key_dim + value_dim]
    q, k, v = torch.split(mixed, [m.key_dim, m.key_dim, m.value_dim], dim=-1)
    q, k = (x.reshape(B, n, -1, m.head_k_dim) for x in (q, k))
    v = v.reshape(B, n, -1, m.head_v_dim)
    beta = b.sigmoid()
    if getattr(m, "allow_neg_eigval", False):
        beta = beta * 2.0
    g = -m.A_log.float().exp() * F.softplus(a.float() + m.dt_bias)  # [B, n, Hv] log decay
    o = ops.delta(q, k, v, g, beta)  # [B, n, Hv, dv]
    norm, proj = (m.norm, m.out_proj) if hasattr(m, "out_proj") else (m.o_norm, m.o_proj)
    o = norm(o.reshape(-1, m.head_v_dim), z.reshape(-1, m.head_v_dim))
    return proj(o.reshape(B, n, -1))


def kimi_delta(m, hidden_states: torch.Tensor, attention_mask, ops) -> torch.Tensor:
    """Kimi Linear's KDA: the gated delta rule with a per-channel forget gate ``g [B, n, H, dk]``."""
    hs = _masked(hidden_states, attention_mask)
    B, n, _ = hs.shape
    mixed = _conv(m, torch.cat([m.q_proj(hs), m.k_proj(hs), m.v_proj(hs)], dim=-1), ops, m.activation)
    q, k, v = (x.reshape(B, n, -1, m.head_dim) for x in torch.split(mixed, [m.qkv_dim] * 3, dim=-1))
    g = m.forget_gate(hs)  # [B, n, H, dk], float32
    beta = torch.sigmoid(m.b_proj(hs))
    o = ops.delta(q, k, v, g, beta)
    gate = m.g_b_proj(m.g_a_proj(hs)).reshape(B, n, -1, m.head_dim)
    return m.o_proj(m.o_norm(o, gate).reshape(B, n, -1))


def mamba2_ssd(m, hidden_states: torch.Tensor, attention_mask, ops) -> torch.Tensor:
    """Mamba2's mixer (Bamba, Granite 4.0 hybrid, Nemotron-H, Falcon-H1 with its muP multipliers): conv over ``[x | B | C]``, then the SSD
    scan ``h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t^T``, ``y_t = C_t h_t + D x_t``, gated norm, out proj."""
    dtype = hidden_states.dtype
    hs = _masked(hidden_states, attention_mask) * getattr(m, "ssm_in_multiplier", 1.0)  # Falcon-H1's muP scales
    B, n, _ = hs.shape
    proj = m.in_proj(hs)
    proj = proj * m.mup_vector if hasattr(m, "mup_vector") else proj
    gate, xbc, dt = proj.split([m.intermediate_size, m.conv_dim, m.num_heads], dim=-1)
    xbc = _masked(_conv(m, xbc, ops, m.activation), attention_mask)
    gs = m.n_groups * m.ssm_state_size
    x, Bm, Cm = torch.split(xbc, [m.intermediate_size, gs, gs], dim=-1)
    dt = F.softplus(dt + m.dt_bias.to(dt.dtype))  # [B, n, H]
    if m.time_step_limit is not None:
        dt = torch.clamp(dt, min=m.time_step_limit[0], max=m.time_step_limit[1])
    A = -torch.exp(m.A_log.float())
    # transformers' scan runs in float32 whatever the model's dtype (float64 stays float64 here)
    up = accum_dtype(x.dtype)
    y = ops.ssd(x.reshape(B, n, m.num_heads, m.head_dim).to(up), dt.to(up), A,
                Bm.reshape(B, n, m.n_groups, m.ssm_state_size).to(up),
                Cm.reshape(B, n, m.n_groups, m.ssm_state_size).to(up), m.D.to(up))
    y = y.reshape(B, n, -1)
    y = m.norm(y, gate) if getattr(m, "mamba_rms_norm", True) else y * F.silu(gate)
    return m.out_proj(y.to(dtype))


def lightning(m, hidden_states: torch.Tensor, attention_mask, ops) -> tuple:
    """MiniMax's lightning attention: ``S_t = exp(-slope) S_{t-1} + k_t v_t^T``, ``o_t = q_t S_t``;
    returns ``(out, None)`` as the module does (its second output is the cache's state)."""
    B, n, _ = hidden_states.shape
    qkv = _masked(m.act_fn(m.qkv_proj(hidden_states)), attention_mask)
    q, k, v = torch.split(qkv.reshape(B, n, m.num_attention_heads, 3 * m.head_dim), m.head_dim, dim=3)
    o = ops.lightning(q, k, v, m.slope_rate.reshape(-1))  # [B, n, H, D]
    o = m.norm(o.reshape(B, n, -1))
    o = F.sigmoid(m.output_gate(hidden_states)) * o
    return m.out_proj(o), None


def short_conv(m, hidden_states: torch.Tensor, attention_mask, ops) -> torch.Tensor:
    """LFM2's gated short convolution: ``y = C * conv(B * x)``."""
    hs = _masked(hidden_states, attention_mask)
    b, c, x = m.in_proj(hs).chunk(3, dim=-1)
    return m.out_proj(c * _conv(m, b * x, ops))


ADAPTERS = {"gdn": gated_deltanet, "kda": kimi_delta, "ssd": mamba2_ssd, "lightning": lightning, "conv": short_conv}

__all__ = ["PATCHED", "SUPPORTED", "REFUSED", "hint", "ADAPTERS", "ShardedOps", "CachedOps", "gated_deltanet", "kimi_delta", "mamba2_ssd", "lightning", "short_conv"]

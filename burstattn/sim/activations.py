"""Activation memory of one training step on one device, by phase and term (pure).

What the model keeps between forward and backward, and what each phase adds on top, counted
tensor by tensor from :mod:`burstattn.models` (docs/simulation.md, "Memory"):

* **kept per layer** (bytes per row): ``none``: both RMSNorms' input and rsqrt, the projections'
  inputs, rotated q, k, v, the attention output and LSE, the MLP's four ``ffn_dim`` tensors; ``full``: the layer
  input; ``remat``: the layer input, attention output and LSE (an attention that does not run as
  the op keeps its own saved tensors instead: ``eager_units`` query shards, from
  ``burstattn.sim.memory.eager_kept_units``).
* **kept by the head**: the whole loss keeps the float32 log-probabilities ``[rows, vocab]``; the
  blockwise loss only its input (the final hidden state).
* **offload** moves the layer inputs (``inputs``) or everything kept (``all``) to host memory.
* **transients**: the forward's attention call and loss chunk; the backward's gradients (all
  parameters), and the larger of the head's backward (logits and their gradients for one chunk)
  and one layer's backward: its recomputation, the activation gradients, the attention call's
  backward buffers (``burstattn.sim.memory.attention_buffers`` less its output and LSE) and one
  MLP chunk; the optimizer step: the gradients and a float32 temporary of the parameters.

Rows: ``rows`` of the residual stream per device (batch x local tokens, / tp with sequence
parallelism), ``attn_rows`` on the attention side (the cp shard, gathered over tp). Validated
against ``burstattn train``'s measured peaks (tests/dist/test_sim_memory.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..models.config import LlamaConfig

GRADIENTS, ATTENTION = "gradients", "attention call"  # the terms Memory keeps apart
STATE_PASSING = "state passing"  # the recurrent layers' summaries (hybrid models)


@dataclass(frozen=True)
class ActivationShape:
    """One device's share of a training step."""

    rows: int
    """Residual-stream rows (batch x local tokens; / tp under sequence parallelism)."""
    attn_rows: int
    """Attention-side rows (batch x the cp shard's tokens)."""
    tp: int = 1
    e: int = 2
    """Bytes per element of the compute dtype."""

    def norm(self, h: int) -> float:
        """Bytes per row an RMSNorm of width ``h`` keeps (:func:`norm_kept`; under sequence
        parallelism its input is a DTensor: the plain-autograd path)."""
        return norm_kept(h, self.e, plain=self.rows < self.attn_rows)


@dataclass
class Activations:
    """Bytes by term at the step's peak phase (:data:`GRADIENTS`, :data:`ATTENTION`, the kept
    activations and the phase's transient), what is kept, what sits in host memory."""

    phase: str
    terms: dict = field(default_factory=dict)
    kept: float = 0.0
    host: float = 0.0
    host_pinned: float = 0.0
    """``host`` as the pinned host allocator holds it: each offloaded tensor a power-of-two block
    (:func:`offloaded_tensors`: the library's power-of-two pieces, ``models.offload.pinned_bytes``)."""
    totals: dict = field(default_factory=dict)
    """Every phase's bytes (the peak phase's is ``total``)."""

    @property
    def total(self) -> float:
        return sum(self.terms.values())

    def binding(self) -> str:
        """The largest term."""
        return max(self.terms, key=self.terms.get) if self.terms else ""


def _dims(m: LlamaConfig, tp: int):
    hq, hkv = m.n_heads // tp, max(1, m.n_kv_heads // tp)
    return m.dim, m.head_dim, hq, hkv, m.ffn_dim / tp, m.vocab_size


def norm_kept(h: int, e: int, plain: bool = False) -> float:
    """Bytes per row an RMSNorm keeps: its input and its per-row rsqrt (the float32 normalised
    values are rebuilt in the backward: ``burstattn.models.norms``). ``plain``: a DTensor input
    (tp-v3's sequence-parallel norms) takes plain autograd, which keeps the float32 input and the
    float32 normalised values (seen in the dry run's saved tensors)."""
    return 8 * h + 4 if plain else h * e + 4


def layer_kept(m: LlamaConfig, s: ActivationShape, checkpointing: str, eager_units: float, through_op: bool,
               mlp_chunk: int = 0, eager_shared: float = 0.0) -> float:
    """Bytes one layer keeps between forward and backward (``none`` with ``mlp_chunk``: the MLP
    half is recomputed, only the attention half is kept). ``eager_shared``: the query shards of an
    eager attention's kept tensors that are the layer's rotated q, k, v, which ``none`` keeps anyway
    (``burstattn.sim.memory.eager_shared_units``)."""
    h, hd, hq, hkv, f, _ = _dims(m, s.tp)
    e, r, a = s.e, s.rows, s.attn_rows
    qu = hq * hd * e
    out_lse = a * (qu + 4 * hq)
    if checkpointing == "full":
        return r * h * e
    if checkpointing == "remat":
        if through_op:
            return r * h * e + out_lse
        return r * h * e + a * qu * eager_units
    attention = a * (hq + 2 * hkv) * hd * e + out_lse  # rotated q, k, v (rotary keeps only positions), out, lse
    if not through_op:
        attention += a * qu * max(0.0, eager_units - 1.0 - eager_shared)
    if mlp_chunk:
        return r * s.norm(h) + a * h * e + attention
    return r * 2 * s.norm(h) + a * 2 * h * e + attention + a * 4 * f * e


def layer_forward(m: LlamaConfig, s: ActivationShape) -> float:
    """One layer's forward working set beside what earlier layers keep (bytes), at the attention call:
    the layer's input, its normed copy (gathered over tp), the rotated q and k and v (the rotation runs
    in chunks of positions: ``models.rope``, its float32 temporaries one chunk's); the call's own output,
    LSE and buffers are the attention call's term. The residual side (input, attention output, its
    projection and the new residual: ``4 x rows x dim``) is smaller for LLaMA's shapes. Counted against
    the dry run's allocations (llama3-8b, one GPU, 65,536 tokens, remat, offload ``all``: 28.7 KB per token
    here, 28.7 measured before the call's output and LSE, bench/results/simulation.md)."""
    h, hd, hq, hkv, _, _ = _dims(m, s.tp)
    e, r, a = s.e, s.rows, s.attn_rows
    return r * h * e + a * (h + (hq + 2 * hkv) * hd) * e


def head_kept(m: LlamaConfig, s: ActivationShape, loss_chunk: int, fused: bool = False) -> float:
    """Bytes the final norm and the loss keep: the float32 log-probabilities of every row, or, in
    chunks, only the final hidden state; the fused loss (``burstattn.models.fused_loss``) keeps the
    norm's input and rsqrt, the gradient of the head's (gathered) input and the float32 weight
    gradient ``vocab / tp x dim``."""
    if fused:
        return s.rows * s.norm(m.dim) + fused_gradients(m, s)
    if loss_chunk:
        return s.rows * m.dim * s.e
    return s.rows * s.norm(m.dim) + s.attn_rows * (m.dim * s.e + 4 * m.vocab_size)


def fused_gradients(m: LlamaConfig, s: ActivationShape) -> float:
    """What the fused loss holds from its forward to its backward beyond its input: the gradient of
    the head's (gathered) input and the float32 weight gradient ``vocab / tp x dim`` (freed by the
    loss's backward, before any layer's)."""
    return s.attn_rows * m.dim * s.e + 4 * m.vocab_size // s.tp * m.dim


def head_transient(m: LlamaConfig, s: ActivationShape, loss_chunk: int, backward: bool, fused: bool = False) -> float:
    """The loss head's extra bytes (counted against the dry run, ``burstattn train --dry-run``, of
    ``burstattn.models.blockwise`` and ``.fused_loss``; tests/unit/test_dryrun_model.py). The
    blockwise loss: in the forward one chunk's float32 logits beside their log-probabilities (the
    16-bit logits are freed by then); in the backward a chunk's recomputed log-probabilities, their
    gradient and the logits' gradient, all float32 (a whole loss keeps its log-probabilities:
    :func:`head_kept`). The fused loss: in the forward the normed input (gathered over tp) and one
    more row copy, a ``[vocab / tp, dim]`` product of the weight gradient, and 16 bytes per element
    of one chunk's ``[rows, vocab / tp]`` (the float32 logits, their shifted copy, exponentials and
    gradient); in the backward the two scaled gradients."""
    v, e = m.vocab_size, s.e
    rows = s.attn_rows if not loss_chunk else min(loss_chunk, s.rows) * s.attn_rows // max(s.rows, 1)
    if fused:
        if backward:
            return s.attn_rows * m.dim * e + v // s.tp * m.dim * (4 + e)
        return 2 * s.attn_rows * m.dim * e + v // s.tp * m.dim * e + rows * v // s.tp * 16
    if not loss_chunk:
        return rows * v * 8 if backward else rows * v * 4  # the log-probabilities are kept (head_kept)
    return rows * v * 12 if backward else rows * v * 8


def mlp_transient(m: LlamaConfig, s: ActivationShape, mlp_chunk: int, recomputed: bool) -> float:
    """One MLP chunk's backward: its forward tensors when they are recomputed (the norm, the gathered
    input, the four ``ffn_dim`` tensors) and the gradients alive at once (two ``ffn_dim`` tensors and
    the residual's)."""
    h, _, _, _, f, _ = _dims(m, s.tp)
    rows = min(mlp_chunk, s.rows) if mlp_chunk else s.rows
    arows = rows * s.attn_rows // max(s.rows, 1)
    forward = rows * s.norm(h) + arows * (h * s.e + 4 * f * s.e) if recomputed else 0.0
    return forward + arows * 2 * f * s.e + rows * 2 * h * s.e


def layer_backward(m: LlamaConfig, s: ActivationShape, checkpointing: str, mlp_chunk: int, eager_units: float,
                   through_op: bool, eager_shared: float = 0.0) -> tuple[float, float]:
    """One layer's backward beyond what is kept and the attention call's buffers: ``(while the
    attention differentiates: the recomputed norm output, q, k, v, and dO; while an MLP chunk
    differentiates)``. Under ``remat`` an attention that is not the op runs outside the checkpoint and
    differentiates from its own saved tensors: the segment before it (norm, projections, rotary) is recomputed
    after its backward, beside the MLP's (the dry run of ``small`` over 4 ranks, ulysses: 13% over before)."""
    h, hd, hq, hkv, _, _ = _dims(m, s.tp)
    e, r, a = s.e, s.rows, s.attn_rows
    grads = a * hq * hd * e + r * h * e  # dO and the residual's gradient (it waits for the attention branch's)
    if checkpointing == "none":
        recompute = 0.0
    elif checkpointing == "full":  # the whole layer again but its input, its MLP in chunks
        recompute = layer_kept(m, s, "none", eager_units, through_op, mlp_chunk=1, eager_shared=eager_shared) - r * h * e
    else:
        recompute = r * (s.norm(h) - h * e) + a * (h * e + (hq + 2 * hkv) * hd * e)
    mlp = mlp_transient(m, s, mlp_chunk, recomputed=checkpointing != "none" or mlp_chunk > 0)
    if checkpointing == "remat" and not through_op:
        return grads, max(mlp, recompute + grads)
    return recompute + grads, mlp + (recompute if checkpointing == "full" else 0.0)


def param_bytes(m: LlamaConfig, tp: int, e: int) -> tuple[float, float, float]:
    """``(one layer, the output head, the embedding)`` parameter bytes on one device (unsharded)."""
    h, kvd = m.dim, m.n_kv_heads * m.head_dim
    layer = (h * (h + 2 * kvd) + h * h + 3 * h * m.ffn_dim) / tp * e + 2 * h * e
    head = m.vocab_size * h / tp * e + h * e
    return layer, head, (0.0 if m.tie_embeddings else m.vocab_size * h / tp * e)


def _norm_tensors(h: int, s: ActivationShape) -> list:
    """Per row, what one RMSNorm keeps, tensor by tensor (:func:`norm_kept`)."""
    return [4 * h, 4 * h, 4] if s.rows < s.attn_rows else [h * s.e, 4]


def offloaded_tensors(m: LlamaConfig, s: ActivationShape, checkpointing: str, offload: str, eager_units: float,
                      through_op: bool, mlp_chunk: int = 0, loss_chunk: int = 0, fused: bool = False,
                      eager_shared: float = 0.0) -> list:
    """The bytes of every tensor ``offload`` copies to host memory in one forward, one entry per storage
    (what the pinned host allocator gets as one block): ``inputs`` each layer's input and the head's; ``all``
    everything :func:`layer_kept` and :func:`head_kept` count, tensor by tensor (they sum to them)."""
    h, hd, hq, hkv, f, v = _dims(m, s.tp)
    e, r, a = s.e, s.rows, s.attn_rows
    head_in = [r * h * e] if (loss_chunk or fused) else []
    if offload == "inputs":
        return [r * h * e] * m.n_layers + head_in
    if offload != "all":
        return []
    q, out_lse = a * hq * hd * e, [a * hq * hd * e, a * hq * 4]
    extra = max(0.0, eager_units - 1.0 - eager_shared) if checkpointing == "none" else eager_units
    eager = [] if through_op else [q] * int(extra) + ([q * (extra - int(extra))] if extra % 1 else [])
    if checkpointing == "full":
        layer = [r * h * e]
    elif checkpointing == "remat":
        layer = [r * h * e] + (out_lse if through_op else eager)
    else:
        norm = [x * r for x in _norm_tensors(h, s)]
        attention = [q, a * hkv * hd * e, a * hkv * hd * e] + out_lse + eager
        mlp = [] if mlp_chunk else norm + [a * h * e] + [a * f * e] * 4
        layer = norm + [a * h * e] + attention + mlp
    if fused:
        head = [x * r for x in _norm_tensors(m.dim, s)] + [a * m.dim * e, 4 * v // s.tp * m.dim]
    elif loss_chunk:
        head = [r * m.dim * e]
    else:
        head = [x * r for x in _norm_tensors(m.dim, s)] + [a * m.dim * e, a * 4 * v]
    return layer * m.n_layers + head


def training_activations(m: LlamaConfig, s: ActivationShape, *, checkpointing: str, eager_units: float,
                         through_op: bool, mlp_chunk: int, loss_chunk: int, offload: str,
                         attention_fwd: float, attention_bwd: float, grads: float, param_fp32: float,
                         fused_loss: bool = False, eager_shared: float = 0.0,
                         state_passing: tuple = (0.0, 0.0)) -> Activations:
    """The bytes at the step's peak phase, by term (``kept activations``, :data:`ATTENTION`,
    :data:`GRADIENTS` and the phase's transient), of the phases: the forward (kept + the attention
    call's forward or a loss chunk), the loss's backward (kept + the head's gradients + logits and
    their gradients), the first layer's backward (kept + the head's and that layer's gradients + the
    attention call's backward buffers and the layer's recomputation, or an MLP chunk), the last
    layer's backward (one layer kept, back from the host where offloaded + the head's and that layer's gradients
    and the other layers') and the optimizer step
    (gradients + a float32 temporary of the parameters). ``attention_fwd`` / ``attention_bwd``: the
    attention call's forward peak and its backward buffers beyond its output and LSE; ``grads``:
    every gradient (sharded, with FSDP); ``eager_shared``: see :func:`layer_kept`; ``state_passing``:
    the recurrent layers' ``(kept summaries, one layer's backward transient)``
    (:func:`burstattn.sim.recurrent.kept_bytes`), kept from the forward to the first layer's backward."""
    layer = layer_kept(m, s, checkpointing, eager_units, through_op, mlp_chunk, eager_shared)
    head = head_kept(m, s, loss_chunk, fused_loss)
    kept = m.n_layers * layer + head
    inputs = (m.n_layers + (1 if loss_chunk or fused_loss else 0)) * s.rows * m.dim * s.e
    host = {"all": kept, "inputs": min(kept, inputs)}.get(offload, 0.0)
    dev = kept - host
    # the loss's backward unpacks what the head kept back onto the device (offload "all": all of it, e.g. a
    # whole loss's float32 log-probabilities; "inputs": the final hidden state of a chunked or fused loss)
    head_back = {"all": head, "inputs": s.rows * m.dim * s.e if (loss_chunk or fused_loss) else 0.0}.get(offload, 0.0)
    # one layer's kept tensors: on the device, and back from the host when it differentiates (an eager
    # attention's own saved tensors, e.g. RSA's scores per head group, come back inside its call's backward)
    one = layer * (dev / kept if kept else 0.0)
    unpacked = min(layer, layer_kept(m, s, checkpointing, 1.0, True, mlp_chunk)) * (host / kept if kept else 0.0)
    after_loss = dev - (fused_gradients(m, s) if fused_loss else 0.0)  # the fused loss's gradients are handed on
    at_attention, at_mlp = layer_backward(m, s, checkpointing, mlp_chunk, eager_units, through_op, eager_shared)
    transient, name = (at_attention + attention_bwd, None) if at_attention + attention_bwd >= at_mlp else (at_mlp, "MLP chunk")
    g_layer, g_head, g_emb = param_bytes(m, s.tp, s.e)
    # of every gradient, the other layers' (done by the last layer's backward; the head's and the embedding's
    # are reduced with the root's at the end under FSDP2, its unsharded head gradient held till then)
    others = (m.n_layers - 1) * g_layer / (m.n_layers * g_layer + g_head + g_emb)
    logits = head_transient(m, s, loss_chunk, False, fused_loss)
    if fused_loss and offload == "all":  # its gradients are filled on the device, offloaded only once saved
        logits += fused_gradients(m, s)
    # the layer's input is part of what every checkpointing mode keeps: counted once, in `dev`, unless offloaded
    working = layer_forward(m, s) - (s.rows * m.dim * s.e if offload == "none" else 0.0)
    k = "kept activations"

    def backward(kept_now: float, grads_now: float) -> dict:
        if name:
            return {k: kept_now, GRADIENTS: grads_now, name: transient}
        return {k: kept_now, GRADIENTS: grads_now, ATTENTION: attention_bwd, "recomputed layer": at_attention}

    phases = {
        "forward": ({k: dev, "layer forward": working, ATTENTION: attention_fwd} if working + attention_fwd >= logits
                    else {k: dev, "logits": logits}),
        "loss backward": {k: dev + min(head_back, host),  # before any weight gradient
                          "logits": head_transient(m, s, loss_chunk, True, fused_loss)},
        "first layer's backward": backward(after_loss + unpacked, g_head + g_layer),
        "last layer's backward": backward(one + unpacked, g_head + g_layer + grads * others),
        "optimizer": {GRADIENTS: grads, "optimizer temporary": param_fp32},
    }
    passing_kept, passing_transient = state_passing
    if passing_kept or passing_transient:
        for name_, extra in (("forward", passing_kept), ("loss backward", passing_kept),
                             ("first layer's backward", passing_kept + passing_transient),
                             ("last layer's backward", passing_transient)):
            phases[name_][STATE_PASSING] = extra
    totals = {p: sum(t.values()) for p, t in phases.items()}
    phase = max(totals, key=totals.get)
    from ..models.offload import pinned_bytes

    pinned = sum(pinned_bytes(x) for x in offloaded_tensors(m, s, checkpointing, offload, eager_units, through_op,
                                                            mlp_chunk, loss_chunk, fused_loss, eager_shared))
    return Activations(phase, phases[phase], kept, host, host_pinned=float(pinned), totals=totals)

"""Rank-side functions of tests/dist/test_hf_hybrid.py: hybrid transformers families from tiny
random configs (no download), their mixers made sequence parallel by burstattn.hf.patch_mixers, against
the same model on one process (transformers' own mixers and eager attention)."""
from __future__ import annotations

import torch

import burstattn
import burstattn.hf as bhf
from burstattn.layouts.named import local_positions
from tests.dist.hf_guard_cases import build as guard_build
from tests.dist.hf_guard_cases import MAMBA, SMALL, VOCAB
from tests.dist.hf_guard_cases import config as guard_config

LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
              linear_conv_kernel_dim=4)
IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=1)  # configs whose defaults are outside the tiny vocab
FAMILIES = ("qwen3_next", "qwen3_5", "olmo_hybrid", "kimi_linear", "bamba", "nemotron_h", "granitemoehybrid",
            "falcon_h1", "minimax", "lfm2")


def config(kind: str):
    """A tiny config of ``kind``: one attention layer and one (or two) mixer layers, hidden 64."""
    import transformers as tf

    if kind == "qwen3_next":
        return tf.Qwen3NextConfig(**SMALL, head_dim=16, layer_types=["linear_attention", "full_attention"],
                                  num_experts=0, **LINEAR)
    if kind == "qwen3_5":
        return tf.Qwen3_5TextConfig(**SMALL, head_dim=16, layer_types=["linear_attention", "full_attention"], **LINEAR)
    if kind == "olmo_hybrid":
        return tf.OlmoHybridConfig(**SMALL, **IDS, layer_types=["linear_attention", "full_attention"], **LINEAR,
                                   linear_allow_neg_eigval=True)
    if kind == "kimi_linear":
        return tf.KimiLinearConfig(**{**SMALL, "num_key_value_heads": 4}, **IDS, kv_lora_rank=16, q_lora_rank=None,
                                   qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, num_local_experts=2,
                                   num_experts_per_tok=1, moe_intermediate_size=32, n_shared_experts=1,
                                   mlp_layer_types=["dense", "dense"], layer_types=["linear_attention",
                                   "full_attention"], linear_head_dim=8, linear_num_heads=4, linear_conv_kernel_dim=4)
    if kind == "nemotron_h":
        return tf.NemotronHConfig(**SMALL, head_dim=16, layers_block_type=["mamba", "attention"], **MAMBA,
                                  n_groups=1, mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16)
    return guard_config(kind)


def build(kind: str, dtype=torch.float32, seed: int = 0):
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config(kind), attn_implementation="eager").to(dtype)
    return model.eval()


def _tokens(batch: int, seq: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(2, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max abs difference over the reference's max magnitude."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _grad_err(grads: dict, ref: dict) -> float:
    """Every parameter's max abs gradient difference over the model's largest reference gradient entry:
    transformers runs these recurrences in float32 whatever the model's dtype, so a parameter whose whole
    gradient is a near-cancelling sum (dt_bias, A_log: ~1e-5 of the largest) carries float32 rounding of
    the larger terms; the error is judged on the gradient's scale, as the loss's and logits' are on theirs."""
    scale = max(float(g.abs().max()) for g in ref.values())
    return max(float((grads[n] - g).abs().max()) for n, g in ref.items()) / scale


def exact(rank: int, world: int, kinds, layouts=("zigzag",), dtype=torch.float32, batch: int = 2,
          seq: int = 24) -> dict:
    """Per ``kind:layout``: loss, logits and every gradient of a sequence-parallel step (patch_mixers +
    shard_batch + sync_gradients) against the same model on one process, as relative errors, and the
    number of gradients compared."""
    out = {}
    ids = _tokens(batch, seq)
    for kind in kinds:
        model = build(kind, dtype)
        ref = model(input_ids=ids, labels=ids)
        ref.loss.backward()
        ref_grads = _grads(model)
        model.zero_grad(set_to_none=True)
        bhf.patch_mixers(model)
        for layout in layouts:
            bhf.register(strategy="burst", backend="reference", layout=layout)
            model.set_attn_implementation("burst")
            bhf.check_model(model)
            batch_kw = bhf.shard_batch(ids, ids)
            with burstattn.comm_stats() as stats:
                res = model(**batch_kw)
                res.loss.backward()
            bhf.sync_gradients(model)
            logits = bhf.gather_logits(res.logits.detach(), shard=batch_kw["burst_shard"])
            grads = _grads(model)
            model.zero_grad(set_to_none=True)
            out[f"{kind}:{layout}"] = dict(
                loss=_rel(res.loss.detach(), ref.loss.detach()), logits=_rel(logits, ref.logits.detach()),
                grads=_grad_err(grads, ref_grads), count=len(ref_grads),
                missing=sorted(set(ref_grads) - set(grads)),
                bytes={op: stats.sent(phase, op) for phase, op in (("forward", "state"), ("backward", "dstate"),
                                                                   ("forward", "halo"), ("backward", "dhalo"))})
        model.set_attn_implementation("eager")
    return out


def packed(rank: int, world: int, kinds, lens=(9, 7, 8)) -> dict:
    """Packed documents (``position_ids`` restarting, a document-balanced partition): the recurrences and
    convolutions restart at every document; loss and gradients against each document run alone."""
    ids = _tokens(1, sum(lens), 2)
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    out = {}
    for kind in kinds:
        model = build(kind)
        total = sum(model(input_ids=doc, labels=doc).loss * (doc.shape[1] - 1) for doc in ids.split(lens, dim=1))
        ref = total / (sum(lens) - len(lens))
        ref.backward()
        ref_grads = _grads(model)
        model.zero_grad(set_to_none=True)
        bhf.patch_mixers(model)
        bhf.register(strategy="burst", backend="reference")  # layout None: shard_batch partitions by documents
        model.set_attn_implementation("burst")
        labels = ids.masked_fill(pos == 0, -100)  # DataCollatorWithFlattening: no label across a document start
        batch = bhf.shard_batch(ids, labels, position_ids=pos)
        res = model(**batch)
        res.loss.backward()
        bhf.sync_gradients(model)
        out[kind] = dict(loss=_rel(res.loss.detach(), ref.detach()), grads=_grad_err(_grads(model), ref_grads),
                         layout=type(batch["burst_shard"].layout).__name__)
    return out


def refused(rank: int, world: int, whats) -> dict:
    """``{case: "<Error>: message"}`` (``"no error"`` when accepted) for ``"<case>:<kind>"`` cases."""
    out = {}
    ids = _tokens(1, 6 * world)
    for what in whats:
        case, _, kind = what.partition(":")
        bhf.register(strategy="burst", backend="reference")
        try:
            model = guard_build(kind) if kind in ("jamba", "falcon_h1") else build(kind)
            if case != "unpatched":
                bhf.patch_mixers(model)
            model.set_attn_implementation("burst")
            if case in ("shard", "unpatched"):
                model(**bhf.shard_batch(ids, ids))
            elif case == "hand":  # this rank's share by hand, without shard_batch
                pos = local_positions(ids.shape[1], rank, world, "zigzag")
                model(input_ids=ids[:, pos], position_ids=pos[None])
            elif case == "generate":
                with torch.no_grad():
                    model.generate(ids[:, :5], max_new_tokens=2, do_sample=False,
                                   **bhf.cache_kwargs(model, bhf.ShardedCache()))
            else:
                raise AssertionError(what)
            out[what] = "no error"
        except (ValueError, TypeError, AttributeError, RuntimeError) as e:
            out[what] = f"{type(e).__name__}: {e}"
    return out


def generate(rank: int, world: int, kinds, prompt: int = 9, new: int = 5) -> dict:
    """Greedy tokens over a ShardedCache (the mixers' states replicated in the cache, the K/V sharded)
    against transformers' own generate on one process: ``{kind: (tokens, reference tokens)}``."""
    ids = _tokens(2, prompt, 5)
    out = {}
    for kind in kinds:
        model = build(kind)
        ref = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        bhf.patch_mixers(model)
        bhf.register(strategy="burst", backend="reference")
        model.set_attn_implementation("burst")
        with torch.no_grad():
            tokens = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                    **bhf.cache_kwargs(model, bhf.ShardedCache()))
        out[kind] = (tokens.tolist(), ref.tolist())
    return out


class float64_everywhere:
    """Inside it a float64 model computes in float64 throughout: transformers' forwards cast to float32 on
    purpose (the Mamba2 scan's ``.float()``, the norms' ``.to(torch.float32)``, eager attention's softmax
    ``dtype=torch.float32``); here a float64 tensor keeps float64 through those casts (other tensors are
    cast as asked). Restored on exit. The float64 reference of :func:`a_log_precision`."""

    def __enter__(self):
        import torch.nn.functional as F

        self.saved = (torch.Tensor.float, torch.Tensor.to, F.softmax)
        real_float, real_to, real_softmax = self.saved

        def keep(x, dtype):
            return torch.float64 if dtype in (torch.float32, torch.float) and x.dtype == torch.float64 else dtype

        def to(x, *args, **kw):
            if "dtype" in kw:
                kw["dtype"] = keep(x, kw["dtype"])
            args = tuple(keep(x, a) if isinstance(a, torch.dtype) else a for a in args)
            return real_to(x, *args, **kw)

        def softmax(x, *args, dtype=None, **kw):
            return real_softmax(x, *args, dtype=keep(x, dtype), **kw)
        torch.Tensor.float = lambda x, *a, **k: x if x.dtype == torch.float64 else real_float(x, *a, **k)
        torch.Tensor.to = to
        F.softmax = softmax
        return self

    def __exit__(self, *exc):
        import torch.nn.functional as F

        torch.Tensor.float, torch.Tensor.to, F.softmax = self.saved
        return False


def _a_log_grads(model, ids, **batch) -> torch.Tensor:
    """The ``A_log`` gradients of one step (every Mamba2 layer's, concatenated, float64)."""
    res = model(**(batch or dict(input_ids=ids, labels=ids)))
    res.loss.backward()
    if batch:
        bhf.sync_gradients(model)
    grads = torch.cat([p.grad.double().flatten() for n, p in model.named_parameters() if n.endswith("A_log")])
    model.zero_grad(set_to_none=True)
    return grads


def a_log_precision(rank: int, world: int, kinds, batch: int = 2, seq: int = 256) -> dict:
    """Per kind: the float32 ``A_log`` gradient's error (max abs difference over the reference's max
    magnitude) against the same model computed in float64 throughout (:class:`float64_everywhere`), for
    transformers' own float32 forward on one process (``"transformers"``) and for the sequence-parallel
    step (``"burstattn"``: patch_mixers + shard_batch, zigzag: 64-token segments at world 2)."""
    ids = _tokens(batch, seq, 3)
    out = {}
    for kind in kinds:
        model = build(kind, torch.float64)
        with float64_everywhere():
            ref = _a_log_grads(model, ids)
        model = build(kind, torch.float32)
        theirs = _a_log_grads(model, ids)
        bhf.patch_mixers(model)
        bhf.register(strategy="burst", backend="reference", layout="zigzag")
        model.set_attn_implementation("burst")
        ours = _a_log_grads(model, ids, **bhf.shard_batch(ids, ids))
        model.set_attn_implementation("eager")
        scale = float(ref.abs().max())
        out[kind] = dict(transformers=float((theirs - ref).abs().max()) / scale,
                         burstattn=float((ours - ref).abs().max()) / scale, count=ref.numel())
    return out

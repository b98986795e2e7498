"""Hybrid transformers families (attention beside linear-attention, Mamba and convolution mixers) over a
real group: the silent wrong answers refused on every rank (or made exact), and the mixers made
sequence parallel by :func:`burstattn.hf.patch_mixers` against the same model on one process.

Tiny random configs (hidden 32-64, 2-3 layers; no download) build in a second on CPU; their torch
fallbacks run without fla / causal-conv1d / mamba_ssm.
"""
from __future__ import annotations

import tempfile

import torch

import burstattn
import burstattn.hf as bhf
from burstattn.layouts.named import local_positions


# ---- guards: refused on every rank, or exact (test_hf_guards.py, unit/test_hf_mixers.py) ---------
VOCAB = 128
SMALL = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=64, max_position_embeddings=256)
MAMBA = dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1, mamba_expand=2)


def guard_config(kind: str):
    """A small config of ``kind`` (hybrids with one attention layer and one layer that mixes otherwise)."""
    import transformers as tf

    if kind == "llama":
        return tf.LlamaConfig(**SMALL)
    if kind == "stablelm":
        return tf.StableLmConfig(**SMALL)
    if kind == "mixtral":
        return tf.MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2)
    if kind == "qwen2_moe":
        return tf.Qwen2MoeConfig(**SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                 shared_expert_intermediate_size=32)
    if kind == "lfm2":
        return tf.Lfm2Config(**{**SMALL, "num_hidden_layers": 3}, layer_types=["conv", "full_attention", "conv"])
    if kind == "lfm2_moe":
        return tf.Lfm2MoeConfig(**SMALL, layer_types=["conv", "full_attention"], num_experts=2,
                                num_experts_per_tok=1, moe_intermediate_size=32, num_dense_layers=2)
    if kind == "granitemoehybrid":
        return tf.GraniteMoeHybridConfig(**SMALL, layer_types=["mamba", "attention"], **MAMBA, num_local_experts=0,
                                         shared_intermediate_size=64)
    if kind == "minimax":
        return tf.MiniMaxConfig(**SMALL, head_dim=16, num_local_experts=2, num_experts_per_tok=1, block_size=8,
                                layer_types=["linear_attention", "full_attention"])
    if kind == "recurrent_gemma":
        return tf.RecurrentGemmaConfig(**{**SMALL, "num_hidden_layers": 3}, lru_width=64, attention_window_size=16,
                                       block_types=["recurrent", "attention", "recurrent"], head_dim=16)
    if kind == "qwen3_next":
        return tf.Qwen3NextConfig(**SMALL, head_dim=16, layer_types=["linear_attention", "full_attention"],
                                  num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32,
                                  shared_expert_intermediate_size=32, linear_num_key_heads=2, linear_num_value_heads=4,
                                  linear_key_head_dim=16, linear_value_head_dim=16)
    if kind == "bamba":
        return tf.BambaConfig(**SMALL, attn_layer_indices=[1], **MAMBA)
    if kind == "falcon_h1":
        return tf.FalconH1Config(**SMALL, head_dim=16, **MAMBA, mamba_d_ssm=128)
    if kind == "jamba":
        return tf.JambaConfig(**SMALL, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                              expert_layer_offset=1, num_experts=2, num_experts_per_tok=1, mamba_d_state=16,
                              mamba_dt_rank=8)
    if kind == "bloom":
        return tf.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=1, n_head=2)
    if kind == "falcon":
        return tf.FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2)
    raise ValueError(kind)


def build_guard_model(kind: str, attn: str = "burst", seed: int = 0):
    """A float32 ``kind`` model with seeded random weights under ``attn`` (``None``: transformers' default)."""
    import transformers as tf

    torch.manual_seed(seed)
    kw = {} if attn is None else {"attn_implementation": attn}
    return tf.AutoModelForCausalLM.from_config(guard_config(kind), **kw).float().eval()


def _guard_tokens(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(2, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def _run(what: str, rank: int, world: int) -> None:
    """Run the case ``what`` (``"<case>"`` or ``"<case>:<kind>"``); raises what burstattn refuses."""
    case, _, kind = what.partition(":")
    ids = _guard_tokens(6 * world)
    bhf.register(strategy="burst", backend="reference")
    if case == "shard":  # a sharded batch (loss and backward) on a model built with attn_implementation="burst"
        model = build_guard_model(kind)
        model(**bhf.shard_batch(ids, ids)).loss.backward()
        bhf.sync_gradients(model)
    elif case == "default_loss":  # from_pretrained / from_config without attn_implementation
        model = build_guard_model(kind, attn=None)
        model(**bhf.shard_batch(ids, ids)).loss.backward()
    elif case == "eager_logits":  # without labels: the logits gathered
        model = build_guard_model(kind, attn="eager")
        batch = bhf.shard_batch(ids)
        bhf.gather_logits(model(**batch).logits, shard=batch["burst_shard"])
    elif case == "sdpa_sync":  # a loss of one's own over the logits, then sync_gradients
        model = build_guard_model(kind, attn="sdpa")
        batch = bhf.shard_batch(ids, ids)
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["shift_labels"].flatten()).backward()
        bhf.sync_gradients(model)
    elif case == "generate":  # ShardedCache generation
        model = build_guard_model(kind)
        with torch.no_grad():
            model.generate(ids[:, :5], max_new_tokens=2, do_sample=False, **bhf.cache_kwargs(model, bhf.ShardedCache()))
    elif case == "router_kwarg":  # the router's aux loss asked for in the forward
        model = build_guard_model(kind)
        model(**bhf.shard_batch(ids, ids), output_router_logits=True)
    elif case == "router_config":  # ... or by the config
        model = build_guard_model(kind)
        model.config.output_router_logits = True
        model(**bhf.shard_batch(ids, ids))
    elif case in ("hand_labels", "hand_shift_labels"):  # the hand-sharded forward of attention.py's docstring
        model = build_guard_model(kind)
        pos = local_positions(ids.shape[1], rank, world, "zigzag")
        kw = {"labels": ids[:, pos]}
        if case == "hand_shift_labels":
            shifted = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], 1)
            kw["shift_labels"] = shifted[:, pos]
        model(input_ids=ids[:, pos], position_ids=pos[None], **kw)
    elif case == "layout_name":  # sharded for "burst" (zigzag), the model runs "burst_striped"
        bhf.register("burst_striped", strategy="burst", layout="striped", backend="reference")
        model = build_guard_model(kind, attn="burst_striped")
        model(**bhf.shard_batch(ids, ids))
    elif case == "switched":  # Bloom / Falcon switched to "burst" (transformers warns and keeps its own)
        model = build_guard_model(kind, attn=None)
        model.set_attn_implementation("burst")
        batch = bhf.shard_batch(ids, ids)
        batch.pop("burst_shard")  # their forward takes no such keyword
        model(**batch)
    elif case == "burst_config":  # Bloom built with "burst" in its config: transformers builds our mask
        cfg = guard_config(kind)
        cfg._attn_implementation = "burst"
        torch.manual_seed(0)
        import transformers as tf

        model = tf.AutoModelForCausalLM.from_config(cfg).eval()
        batch = bhf.shard_batch(ids, ids)
        batch.pop("burst_shard")
        model(**batch)
    else:
        raise AssertionError(what)


def refusals(rank: int, world: int, whats: list) -> dict:
    """``{case: "<Error>: message"}`` (``"no error"`` when accepted) for every case of ``whats``."""
    out = {}
    for what in whats:
        try:
            _run(what, rank, world)
            out[what] = "no error"
        except (ValueError, TypeError, IndexError, KeyError, RuntimeError, NotImplementedError) as e:
            out[what] = f"{type(e).__name__}: {e}"
    return out


def guard_exact(rank: int, world: int, kind: str, seq: int = 23) -> dict:
    """Loss and every gradient of a ``shard_batch`` forward/backward against the eager single process."""
    bhf.register(strategy="burst", backend="reference")
    model = build_guard_model(kind, attn="eager")
    ids = _guard_tokens(seq, 3)
    ref = model(input_ids=ids, labels=ids)
    ref.loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    model.set_attn_implementation("burst")
    bhf.check_model(model)
    out = model(**bhf.shard_batch(ids, ids))
    out.loss.backward()
    bhf.sync_gradients(model)
    grad_err = max(float((p.grad - ref_grads[n]).abs().max()) for n, p in model.named_parameters() if n in ref_grads)
    return dict(loss_err=float((out.loss - ref.loss).abs()), grad_err=grad_err, grads=len(ref_grads))


def trainer_refusals(rank: int, world: int, kinds: list) -> dict:
    """ContextParallelTrainer on a model of each of ``kinds``: ``{kind: the message raised at construction}``
    (MoE kinds with ``output_router_logits=True``)."""
    from tests.dist.cases.hf_trainer import PadCollator, TrainerCase, _args, _reset_accelerate, dataset

    out = {}
    for kind in kinds:
        _reset_accelerate(rank, world)
        case = TrainerCase(world=world, cp=world)
        model = build_guard_model(kind, attn=None).train()
        if kind in ("mixtral", "qwen2_moe"):
            model.config.output_router_logits = True
        out[kind] = "no error"
        with tempfile.TemporaryDirectory() as tmp:
            try:
                bhf.ContextParallelTrainer(model=model, args=_args(case, tmp, 2, "gloo"), train_dataset=dataset(case),
                                           data_collator=PadCollator("right"), backend="reference")
            except ValueError as e:
                out[kind] = str(e)
    return out


def token_count(rank: int, world: int) -> dict:
    """ContextParallelMixin over a Trainer that counts tokens as TRL's SFTTrainer does (each rank's
    ``position_ids.size(1)``, gathered over every process, into ``_total_train_tokens``): the count
    after 3 packed steps, and the real tokens the examples hold."""
    from collections import defaultdict

    import transformers as tf

    from tests.dist.cases.hf_models import build_causal_lm
    from tests.dist.cases.hf_trainer import TrainerCase, _args, _reset_accelerate

    class CountsLikeTRL(tf.Trainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._total_train_tokens, self._metrics = 0, {"train": defaultdict(list)}

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            out = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                       num_items_in_batch=num_items_in_batch)
            if "attention_mask" in inputs:
                local = inputs["attention_mask"].sum()
            else:
                local = torch.tensor(inputs["position_ids"].size(1))
            self._total_train_tokens += int(self.accelerator.gather_for_metrics(local).sum())
            self._metrics["train"]["num_tokens"] = [self._total_train_tokens]
            return out

    class CP(bhf.ContextParallelMixin, CountsLikeTRL):
        pass

    _reset_accelerate(rank, world)
    case = TrainerCase(world=world, cp=world)
    gen = torch.Generator().manual_seed(5)  # odd lengths, 3 per row: every packed row is odd, the layout pads it
    lengths = (5, 7, 9, 11, 13, 3, 15, 7, 9)
    data = [{"input_ids": torch.randint(1, VOCAB, (n,), generator=gen).tolist()} for n in lengths]
    with tempfile.TemporaryDirectory() as out:
        trainer = CP(model=build_causal_lm("llama").train(), args=_args(case, out, case.per_device, "gloo"),
                     train_dataset=data, data_collator=tf.DataCollatorWithFlattening(), backend="reference")
        trainer.train()
    return dict(counted=trainer._total_train_tokens, logged=trainer._metrics["train"]["num_tokens"][-1],
                real=sum(len(x["input_ids"]) for x in data))


# ---- hybrid families made sequence parallel (test_hf_hybrid_parallel.py, unit/test_hf_hybrid.py) ----
LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
              linear_conv_kernel_dim=4)
IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=1)  # configs whose defaults are outside the tiny vocab
FAMILIES = ("qwen3_next", "qwen3_5", "olmo_hybrid", "kimi_linear", "bamba", "nemotron_h", "granitemoehybrid",
            "falcon_h1", "minimax", "lfm2")


def hybrid_config(kind: str):
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


def build_hybrid(kind: str, dtype=torch.float32, seed: int = 0):
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(hybrid_config(kind), attn_implementation="eager").to(dtype)
    return model.eval()


def _batch_tokens(batch: int, seq: int, seed: int = 1) -> torch.Tensor:
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


def hybrid_exact(rank: int, world: int, kinds, layouts=("zigzag",), dtype=torch.float32, batch: int = 2,
          seq: int = 24) -> dict:
    """Per ``kind:layout``: loss, logits and every gradient of a sequence-parallel step (patch_mixers +
    shard_batch + sync_gradients) against the same model on one process, as relative errors, and the
    number of gradients compared."""
    out = {}
    ids = _batch_tokens(batch, seq)
    for kind in kinds:
        model = build_hybrid(kind, dtype)
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
    ids = _batch_tokens(1, sum(lens), 2)
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    out = {}
    for kind in kinds:
        model = build_hybrid(kind)
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
    ids = _batch_tokens(1, 6 * world)
    for what in whats:
        case, _, kind = what.partition(":")
        bhf.register(strategy="burst", backend="reference")
        try:
            model = build_guard_model(kind) if kind in ("jamba", "falcon_h1") else build_hybrid(kind)
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
    ids = _batch_tokens(2, prompt, 5)
    out = {}
    for kind in kinds:
        model = build_hybrid(kind)
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
    ids = _batch_tokens(batch, seq, 3)
    out = {}
    for kind in kinds:
        model = build_hybrid(kind, torch.float64)
        with float64_everywhere():
            ref = _a_log_grads(model, ids)
        model = build_hybrid(kind, torch.float32)
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

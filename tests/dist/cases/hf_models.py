"""transformers models under ``attn_implementation="burst"`` over a real group: a small Llama trained and
generating, saved and loaded; the families with attention options of their own (Gemma 2, gpt-oss, a
DeepSeek-V3-style MLA model, the encoder-decoder T5Gemma); the blockwise causal-LM loss.

Every rank builds the same small model with random weights (no download) and the same full batch from
the seed; transformers' eager attention on one process is the reference.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

import burstattn
import burstattn.hf as bhf


# ---- a small Llama: train, generate, save and load (test_hf.py, test_generate_cli.py) ------------
VOCAB = 128


@dataclass(frozen=True)
class HfCase:
    """One model / world / strategy combination."""

    kind: str  # "llama", "mistral" (sliding window 8), "qwen3", "qwen2"
    world: int
    strategy: str = "burst"
    layout: Optional[str] = None  # None: the strategy's default
    seq: int = 21  # not a multiple of 2P: shard_batch right-pads
    batch: int = 2
    new_tokens: int = 6
    seed: int = 0
    options: tuple = ()  # the strategy's own options, as (name, value) pairs

    def id(self) -> str:
        return f"{self.kind}-w{self.world}-{self.strategy}-{self.layout}-n{self.seq}{dict(self.options) or ''}"


def build_causal_lm(kind: str, seed: int = 0):
    """A 2-layer float32 model of ``kind`` (GQA 4/2, head_dim 16) with seeded random weights."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    configs = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM, {}),
               "mistral": (tf.MistralConfig, tf.MistralForCausalLM, {"sliding_window": 8}),
               "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, {"head_dim": 16}),
               "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, {})}
    if kind not in configs:  # a hybrid family (tests/dist/cases/hf_hybrid.py)
        from tests.dist.cases.hf_hybrid import build_hybrid

        return build_hybrid(kind, seed=seed)
    cfg_cls, model_cls, extra = configs[kind]
    torch.manual_seed(seed)
    return model_cls(cfg_cls(**common, **extra)).float().eval()


def _case_tokens(case: HfCase) -> torch.Tensor:
    gen = torch.Generator().manual_seed(case.seed + 1)
    return torch.randint(0, VOCAB, (case.batch, case.seq), generator=gen)


def _layout(case: HfCase) -> str:
    return case.layout or burstattn.strategies.STRATEGIES[case.strategy].default_layout


def train_and_generate(rank: int, world: int, case: HfCase) -> dict:
    """Loss, logits and gradients of a sequence-parallel forward/backward, and greedy generation over a
    ShardedCache, each against the eager single-process model; plus the decode bytes and shard sizes."""
    bhf.register(strategy=case.strategy, layout=case.layout, backend="reference", **dict(case.options))
    model = build_causal_lm(case.kind, case.seed)
    ids = _case_tokens(case)
    model.set_attn_implementation("eager")
    ref = model(input_ids=ids, labels=ids)
    ref.loss.backward()
    ref_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    prompt = ids[:1, :case.seq - 4]
    ref_tokens = model.generate(prompt, max_new_tokens=case.new_tokens, do_sample=False)
    model.zero_grad(set_to_none=True)

    model.set_attn_implementation("burst")
    batch = bhf.shard_batch(ids, ids, layout=_layout(case))
    out = model(**batch)
    out.loss.backward()
    bhf.sync_gradients(model)
    logits = bhf.gather_logits(out.logits.detach(), layout=_layout(case))[:, :case.seq]
    grad_err = max(float((p.grad - ref_grads[name]).abs().max()) for name, p in model.named_parameters())
    cache = bhf.ShardedCache()
    with burstattn.comm_stats() as stats, torch.no_grad():
        tokens = model.generate(prompt, max_new_tokens=case.new_tokens, do_sample=False, **bhf.cache_kwargs(model, cache))
    return dict(loss_err=float((out.loss.detach() - ref.loss.detach()).abs()),
                logits_err=float((logits - ref.logits.detach()).abs().max()), grad_err=grad_err,
                tokens=tokens, ref_tokens=ref_tokens, decode_sent=stats.sent(op="decode"),
                shard_len=int(cache.layers[0].keys.shape[-2]), total=cache.get_seq_length(),
                agree_sent=stats.sent(op="agree"),
                other_ops=sorted(op for phase in stats.as_dict().values() for op in phase if op not in ("decode", "agree")))


def padding_refused(rank: int, world: int, masked_rank: int) -> str:
    """A 2-D attention_mask with a zero on ``masked_rank`` only: every rank must raise."""
    bhf.register(strategy="burst", backend="reference")
    model = build_causal_lm("llama")
    model.set_attn_implementation("burst")
    batch = bhf.shard_batch(_case_tokens(HfCase("llama", world, seq=8 * world)))
    mask = torch.ones_like(batch["input_ids"])
    if rank == masked_rank:
        mask[0, 0] = 0
    try:
        model(**batch, attention_mask=mask)
    except ValueError as e:
        return str(e)
    return "no error"


def save_load_generate(rank: int, world: int, directory: str) -> dict:
    """Rank 0 saves a model with save_pretrained; every rank loads it from the directory with
    attn_implementation='burst' and generates over a ShardedCache."""
    import torch.distributed as dist
    import transformers as tf

    bhf.register(strategy="burst", backend="reference")
    if rank == 0:
        build_causal_lm("qwen2", seed=3).save_pretrained(directory)
    if dist.is_initialized():
        dist.barrier()
    prompt = _case_tokens(HfCase("qwen2", world, seq=13))[:1]
    ref = tf.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager", dtype=torch.float32)
    ref_tokens = ref.generate(prompt, max_new_tokens=5, do_sample=False)
    model = tf.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="burst", dtype=torch.float32)
    tokens = model.generate(prompt, max_new_tokens=5, do_sample=False, **bhf.cache_kwargs(model, bhf.ShardedCache()))
    return dict(tokens=tokens, ref_tokens=ref_tokens, impl=model.config._attn_implementation)


# ---- families with attention options of their own (test_hf_families.py, test_hf_guards.py) -------
def _sharpen(model, factor: float = 12.0):
    """Scale the query/key projections up so that scores are O(1-10): with the tiny default init the
    scores are ~0 and a softcap would change nothing the test could see."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(factor)
    return model


def build_family(kind: str, seed: int = 0):
    """A 2-layer float32 model of ``kind`` with seeded random weights (no download)."""
    import transformers as tf

    torch.manual_seed(seed)
    small = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=512)
    if kind == "gemma2":  # softcap on every layer, a sliding window of 8 on alternate layers
        cfg = tf.Gemma2Config(**small, intermediate_size=128, num_key_value_heads=2, head_dim=16, sliding_window=8,
                              attn_logit_softcapping=2.0)
        return _sharpen(tf.Gemma2ForCausalLM(cfg).float().eval())
    if kind == "gpt_oss":  # learned sinks, alternating sliding windows, a small MoE
        cfg = tf.GptOssConfig(**small, intermediate_size=64, num_key_value_heads=2, head_dim=16, sliding_window=8,
                              num_local_experts=4, num_experts_per_tok=2)
        model = tf.GptOssForCausalLM(cfg).float().eval()
        with torch.no_grad():  # away from 0 so that they matter
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(1.0, 1.0)
        return model
    if kind == "deepseek_v3":  # MLA: q/k head size 24 (16 + 8 rope), v head size 16
        cfg = tf.DeepseekV3Config(**small, intermediate_size=128, moe_intermediate_size=32, num_key_value_heads=4,
                                  q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
                                  v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
                                  first_k_dense_replace=1, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
        return tf.DeepseekV3ForCausalLM(cfg).float().eval()
    if kind in ("falcon", "falcon_alibi"):  # dispatches through the interface since transformers 5.25
        cfg = tf.FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                              new_decoder_architecture=True, num_kv_heads=2, alibi=kind == "falcon_alibi")
        return tf.FalconForCausalLM(cfg).float().eval()
    if kind == "t5gemma":  # bidirectional encoder (sliding windows), causal decoder, cross-attention, softcap
        sub = dict(**small, intermediate_size=128, num_key_value_heads=2, head_dim=16, sliding_window=6,
                   attn_logit_softcapping=2.0)
        cfg = tf.T5GemmaConfig(encoder=tf.T5GemmaModuleConfig(**sub), decoder=tf.T5GemmaModuleConfig(**sub),
                               vocab_size=VOCAB)
        return _sharpen(tf.T5GemmaForConditionalGeneration(cfg).float().eval())
    if kind == "gemma4_kv_shared":  # the last 2 of 4 layers reuse the K/V of the last earlier layer of their type
        cfg = tf.Gemma4TextConfig(**dict(small, num_hidden_layers=4), intermediate_size=128, num_key_value_heads=2,
                                  head_dim=16, sliding_window=8, num_kv_shared_layers=2,
                                  layer_types=["sliding_attention", "full_attention"] * 2,
                                  vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8)
        return tf.Gemma4ForCausalLM(cfg).float().eval()
    raise ValueError(kind)


def falcon_dispatches() -> bool:
    """Whether this transformers' Falcon dispatches its attention through the interface (5.25 does; before,
    check_model refuses it as a model that does not: tests/dist/test_hf_guards.py)."""
    import inspect

    from transformers.models.falcon import modeling_falcon

    return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(modeling_falcon)


def _family_tokens(batch: int, seq: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + 1)
    return torch.randint(2, VOCAB, (batch, seq), generator=gen)


def _grad_err(model, ref_grads: dict) -> float:
    return max(float((p.grad - ref_grads[name]).abs().max()) for name, p in model.named_parameters()
               if name in ref_grads)


def decoder_only(rank: int, world: int, kind: str, seq: int = 21, new_tokens: int = 6) -> dict:
    """Loss, logits and every parameter's gradient of a sequence-parallel forward/backward, and greedy
    tokens over a ShardedCache, each against the eager single-process model."""
    bhf.register(strategy="burst", backend="auto")
    model = build_family(kind)
    ids = _family_tokens(2, seq, 0)
    model.set_attn_implementation("eager")
    ref = model(input_ids=ids, labels=ids)
    ref.loss.backward()
    ref_grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    prompt = ids[:1, :seq - 4]
    ref_tokens = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    model.zero_grad(set_to_none=True)

    model.set_attn_implementation("burst")
    bhf.check_model(model)
    batch = bhf.shard_batch(ids, ids)
    out = model(**batch)
    out.loss.backward()
    bhf.sync_gradients(model)
    logits = bhf.gather_logits(out.logits.detach(), shard=batch["burst_shard"])
    with torch.no_grad():
        tokens = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                past_key_values=bhf.ShardedCache())
    return dict(loss_err=float((out.loss.detach() - ref.loss.detach()).abs()),
                logits_err=float((logits - ref.logits.detach()).abs().max()), grad_err=_grad_err(model, ref_grads),
                grads=len(ref_grads), tokens=tokens, ref_tokens=ref_tokens)


def _greedy(model, enc: torch.Tensor, start: int, steps: int, sharded: bool) -> torch.Tensor:
    """Greedy decoding by full forwards (no cache): sequence-parallel (``sharded``) or on one process."""
    dec = torch.full((enc.shape[0], 1), start, dtype=torch.long)
    for _ in range(steps):
        if sharded:
            logits = bhf.gather_logits(model(**bhf.shard_seq2seq_batch(enc, dec)).logits)[:, :dec.shape[1]]
        else:
            logits = model(input_ids=enc, decoder_input_ids=dec).logits
        dec = torch.cat([dec, logits[:, -1].argmax(-1, keepdim=True)], 1)
    return dec


def encoder_decoder(rank: int, world: int, enc_len: int = 16, dec_len: int = 11, new_tokens: int = 5) -> dict:
    """T5Gemma: loss, logits and gradients of a sequence-parallel forward/backward (encoder and
    decoder sequences sharded, cross-attention between them), and greedy tokens by sharded forwards,
    against the eager single-process model (and its ``generate``)."""
    bhf.register(strategy="burst", backend="auto")
    model = build_family("t5gemma")
    enc, labels = _family_tokens(2, enc_len, 3), _family_tokens(2, dec_len, 4)
    start = model.generation_config.decoder_start_token_id
    start = model.config.decoder.bos_token_id if start is None else start
    dec = torch.cat([torch.full((2, 1), start), labels[:, :-1]], 1)  # shifted right
    model.set_attn_implementation("eager")
    ref = model(input_ids=enc, decoder_input_ids=dec, labels=labels)
    ref.loss.backward()
    ref_grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    with torch.no_grad():
        ref_tokens = _greedy(model, enc[:1], start, new_tokens, sharded=False)
        gen_tokens = model.generate(enc[:1], max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    model.zero_grad(set_to_none=True)

    model.set_attn_implementation("burst")
    bhf.check_model(model)
    out = model(**bhf.shard_seq2seq_batch(enc, dec, labels))
    out.loss.backward()
    bhf.sync_gradients(model)
    logits = bhf.gather_logits(out.logits.detach())[:, :dec_len]
    with torch.no_grad():
        tokens = _greedy(model, enc[:1], start, new_tokens, sharded=True)
    return dict(loss_err=float((out.loss.detach() - ref.loss.detach()).abs()),
                logits_err=float((logits - ref.logits.detach()).abs().max()), grad_err=_grad_err(model, ref_grads),
                grads=len(ref_grads), tokens=tokens, ref_tokens=ref_tokens, gen_tokens=gen_tokens)


def refused(rank: int, world: int, what: str) -> str:
    """The error of a model or option burstattn cannot honour (``"no error"`` if none)."""
    import transformers as tf

    try:
        if what == "bloom":
            bhf.check_model(tf.BloomForCausalLM(tf.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=1, n_head=2)))
        elif what == "bloom_sync":  # the manual loop, without check_model: refused before the optimizer step
            bhf.register(strategy="burst", backend="auto")
            model = tf.BloomForCausalLM(tf.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=1, n_head=2))
            model.set_attn_implementation("burst")  # transformers warns and keeps its own attention
            ids = _family_tokens(1, 8 * world, 0)
            batch = bhf.shard_batch(ids, labels=ids)
            batch.pop("burst_shard", None)  # Bloom's forward takes no such keyword
            model(**batch).loss.backward()
            bhf.sync_gradients(model)
        elif what == "falcon_alibi":  # the bias rides in the model's own mask: refused at the first forward
            bhf.register(strategy="burst", backend="auto")
            model = build_family("falcon_alibi")
            model.set_attn_implementation("burst")
            model(**bhf.shard_batch(_family_tokens(1, 8 * world, 0)))
        elif what == "t5gemma_generate":  # every rank runs the same tokens: no shard to attend to
            bhf.register(strategy="burst", backend="auto")
            model = build_family("t5gemma")
            model.set_attn_implementation("burst")
            with torch.no_grad():
                model.generate(_family_tokens(1, 16, 3), max_new_tokens=2, do_sample=False)
        elif what == "ulysses_sinks":
            bhf.register(strategy="ulysses", backend="auto")
            model = build_family("gpt_oss")
            model.set_attn_implementation("burst")
            model(**bhf.shard_batch(_family_tokens(1, 8 * world, 0)))
        elif what == "gemma4_logits_to_keep":  # each rank's last row is not the sequence's: refused
            bhf.register(strategy="burst", backend="auto")
            model = build_family("gemma4_kv_shared")
            model.set_attn_implementation("burst")
            model(**bhf.shard_batch(_family_tokens(1, 8 * world, 0)), logits_to_keep=1)
        elif what == "unknown_kwarg":
            bhf.register(strategy="burst", backend="auto")
            model = build_family("gemma2")
            model.set_attn_implementation("burst")
            model(**bhf.shard_batch(_family_tokens(1, 8 * world, 0)), position_bias=torch.ones(1))
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


# ---- the blockwise causal-LM loss (test_hf_loss.py) ----------------------------------------------
def blockwise_hf_loss(rank: int, world: int, chunk: int, seq: int, fused: bool = False) -> dict:
    """``causal_lm_loss`` from the last hidden states against ``model(**batch).loss`` on the same
    sharded batch (and the gradients after ``sync_gradients``), a small random Llama."""
    import transformers as tf

    import burstattn.hf as bhf

    bhf.register(strategy="burst", backend="reference")
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    model = tf.LlamaForCausalLM(cfg).float()
    model.set_attn_implementation("burst")
    ids = torch.randint(0, 128, (2, seq), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, : seq // 3] = -100  # a prompt masked out of the loss
    batch = bhf.shard_batch(ids, labels)
    ref = model(**batch).loss
    ref.backward()
    bhf.sync_gradients(model)
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    hidden = model.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).last_hidden_state
    loss = bhf.causal_lm_loss(model, hidden, batch["shift_labels"], batch["num_items_in_batch"], chunk_size=chunk,
                              fused=fused)
    loss.backward()
    bhf.sync_gradients(model)
    err = max(float((p.grad - want[n]).norm() / want[n].norm()) for n, p in model.named_parameters())
    try:
        bhf.causal_lm_loss(model, hidden, batch["shift_labels"], chunk_size=0)
        refused = ""
    except ValueError as e:
        refused = str(e)
    return dict(loss=float(loss), ref=float(ref), grad_err=err, refused=refused,
                softcap=_softcapped(model, hidden.detach(), batch) if fused else None)


def _softcapped(model, hidden, batch) -> tuple[float, float]:
    """The fused and unfused losses with a final logit softcap (Gemma 2's), and the relative
    difference of the hidden states' and head's gradients."""
    import burstattn.hf as bhf

    model.config.final_logit_softcapping = 0.5  # small: most logits are in tanh's curved part
    grads, losses = [], []
    for fused in (False, True):
        h = hidden.clone().requires_grad_(True)
        model.zero_grad(set_to_none=True)
        loss = bhf.causal_lm_loss(model, h, batch["shift_labels"], chunk_size=3, fused=fused)
        loss.backward()
        losses.append(float(loss))
        grads.append(torch.cat([h.grad.flatten(), model.lm_head.weight.grad.flatten()]))
    model.config.final_logit_softcapping = None
    return abs(losses[0] - losses[1]) / losses[0], float((grads[1] - grads[0]).norm() / grads[0].norm())

"""Rank-side functions of tests/dist/test_hf.py (module-level so they pickle by reference).

Every rank builds the same small transformers model with random weights (no download) and the
same full batch from the seed; the eager single-process model on the full batch is the reference.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

import burstattn
import burstattn.hf as bhf

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


def build(kind: str, seed: int = 0):
    """A 2-layer float32 model of ``kind`` (GQA 4/2, head_dim 16) with seeded random weights."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    configs = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM, {}),
               "mistral": (tf.MistralConfig, tf.MistralForCausalLM, {"sliding_window": 8}),
               "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, {"head_dim": 16}),
               "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, {})}
    if kind not in configs:  # a hybrid family (tests/dist/hf_hybrid_cases.py)
        from tests.dist.hf_hybrid_cases import build as hybrid_build

        return hybrid_build(kind, seed=seed)
    cfg_cls, model_cls, extra = configs[kind]
    torch.manual_seed(seed)
    return model_cls(cfg_cls(**common, **extra)).float().eval()


def _tokens(case: HfCase) -> torch.Tensor:
    gen = torch.Generator().manual_seed(case.seed + 1)
    return torch.randint(0, VOCAB, (case.batch, case.seq), generator=gen)


def _layout(case: HfCase) -> str:
    return case.layout or burstattn.strategies.STRATEGIES[case.strategy].default_layout


def train_and_generate(rank: int, world: int, case: HfCase) -> dict:
    """Loss, logits and gradients of a sequence-parallel forward/backward, and greedy generation over a
    ShardedCache, each against the eager single-process model; plus the decode bytes and shard sizes."""
    bhf.register(strategy=case.strategy, layout=case.layout, backend="reference", **dict(case.options))
    model = build(case.kind, case.seed)
    ids = _tokens(case)
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
    model = build("llama")
    model.set_attn_implementation("burst")
    batch = bhf.shard_batch(_tokens(HfCase("llama", world, seq=8 * world)))
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
        build("qwen2", seed=3).save_pretrained(directory)
    if dist.is_initialized():
        dist.barrier()
    prompt = _tokens(HfCase("qwen2", world, seq=13))[:1]
    ref = tf.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager", dtype=torch.float32)
    ref_tokens = ref.generate(prompt, max_new_tokens=5, do_sample=False)
    model = tf.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="burst", dtype=torch.float32)
    tokens = model.generate(prompt, max_new_tokens=5, do_sample=False, **bhf.cache_kwargs(model, bhf.ShardedCache()))
    return dict(tokens=tokens, ref_tokens=ref_tokens, impl=model.config._attn_implementation)

"""transformers' training path over a real group: :class:`burstattn.hf.ContextParallelTrainer` against the
plain single-process ``transformers.Trainer``, packed and padded batches, dynamic dispatch, and TRL's
SFTTrainer.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, replace
from typing import Optional

import torch

import burstattn.hf as bhf
from burstattn.config import IGNORE_INDEX
from tests.dist.cases.hf_models import VOCAB, build_causal_lm


# ---- ContextParallelTrainer against transformers.Trainer (test_hf_trainer.py) --------------------
# Both sides build the same tiny model (hidden 64, 2 layers, seeded) and see the same examples: the plain
# Trainer with ``dp * per_device`` rows per step (what accelerate gives ``dp`` processes of ``per_device``
# rows between them), eager attention on right- or left-padded rows; the context-parallel one with packed
# rows (``DataCollatorWithFlattening``) or the same padded rows.
LENGTHS = (38, 5, 11, 3, 17, 7, 26, 4, 9, 14, 6, 21)  # a mix: one longer than a shard at world 4, many short


@dataclass(frozen=True)
class TrainerCase:
    """One Trainer comparison."""

    kind: str = "llama"
    strategy: str = "burst"
    data: str = "packed"  # packed | right | left (padding of the context-parallel side)
    world: int = 2
    cp: int = 2
    per_device: int = 3
    accumulation: int = 1
    steps: int = 3
    seed: int = 0
    optim: Optional[str] = None  # TrainingArguments.optim (None: its default, AdamW)

    def id(self) -> str:
        return (f"{self.kind}-{self.strategy}-{self.data}-w{self.world}cp{self.cp}-b{self.per_device}"
                f"-ga{self.accumulation}" + (f"-{self.optim}" if self.optim else ""))


def dataset(case: TrainerCase) -> list[dict]:
    gen = torch.Generator().manual_seed(case.seed + 5)
    n = case.steps * case.accumulation * case.per_device * (case.world // case.cp)
    return [{"input_ids": torch.randint(1, VOCAB, (LENGTHS[i % len(LENGTHS)],), generator=gen).tolist()}
            for i in range(n)]


class PadCollator:
    """Rows padded on ``side``; labels = ids, -100 at pads and at each row's first token (as
    DataCollatorWithFlattening marks a document's first label), so no pad ever predicts a target."""

    def __init__(self, side: str) -> None:
        self.side = side

    def __call__(self, features: list[dict]) -> dict:
        ids, mask, labels = padded([torch.tensor(f["input_ids"]) for f in features], self.side)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _args(case: TrainerCase, out: str, per_device: int, backend=None):
    import transformers as tf

    return tf.TrainingArguments(output_dir=out, per_device_train_batch_size=per_device,
                                per_device_eval_batch_size=per_device, gradient_accumulation_steps=case.accumulation,
                                max_steps=case.steps, learning_rate=1e-4, logging_steps=1, save_strategy="no",
                                report_to="none", use_cpu=True, ddp_backend=backend, seed=case.seed,
                                disable_tqdm=True, dataloader_num_workers=0,
                                **({} if case.optim is None else {"optim": case.optim}))


def _result(trainer, model) -> dict:
    steps = [h for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]
    params = {k: p.detach().clone() for k, p in model.named_parameters()}
    return dict(losses=[h["loss"] for h in steps], grad_norms=[h["grad_norm"] for h in steps], params=params)


def reference(case: TrainerCase) -> dict:
    """The plain single-process Trainer (eager attention, right-padded rows); call it with no process group."""
    import transformers as tf

    model = build_causal_lm(case.kind, case.seed).train()
    model.set_attn_implementation("eager")
    dp = case.world // case.cp
    with tempfile.TemporaryDirectory() as out:
        trainer = tf.Trainer(model=model, args=_args(case, out, dp * case.per_device), train_dataset=dataset(case),
                             data_collator=PadCollator("left" if case.data == "left" else "right"))
        trainer.train()
        res = _result(trainer, model)
        res["eval_loss"] = trainer.evaluate(dataset(case)[:8])["eval_loss"]
        res["pred"] = torch.as_tensor(trainer.predict(dataset(case)[:3]).predictions)
    return res


def _reset_accelerate(rank: int, world: int) -> None:
    from burstattn.testing.accelerate_env import local_group_environment

    local_group_environment(rank, world)


def context_parallel(rank: int, world: int, case: TrainerCase) -> dict:
    """ContextParallelTrainer on this pool; also evaluate, predict and save_model."""
    import transformers as tf

    import burstattn.hf as bhf

    _reset_accelerate(rank, world)
    model = build_causal_lm(case.kind, case.seed).train()
    collate = tf.DataCollatorWithFlattening() if case.data == "packed" else PadCollator(case.data)
    with tempfile.TemporaryDirectory() as out:
        trainer = bhf.ContextParallelTrainer(model=model, args=_args(case, out, case.per_device, "gloo"),
                                             train_dataset=dataset(case), data_collator=collate, cp_size=case.cp,
                                             strategy=case.strategy, backend="reference")
        trainer.train()
        res = _result(trainer, model)
        res["eval_loss"] = trainer.evaluate(dataset(case)[:8])["eval_loss"]
        res["pred"] = torch.as_tensor(trainer.predict(dataset(case)[:3]).predictions)
        if rank == 0 and case == replace(case, data="packed", world=2):
            trainer.save_model(os.path.join(out, "saved"))
            loaded = tf.AutoModelForCausalLM.from_pretrained(os.path.join(out, "saved"), dtype=torch.float32)
            res["saved_impl"] = loaded.config._attn_implementation
            res["saved_equal"] = all(torch.equal(p, res["params"][k]) for k, p in loaded.named_parameters())
    return res


def trainer_refusal(rank: int, world: int, what: str) -> str:
    """A refused Trainer configuration: every rank raises; the message."""
    import transformers as tf

    import burstattn.hf as bhf

    _reset_accelerate(rank, world)
    case = TrainerCase(world=world, cp=world)
    with tempfile.TemporaryDirectory() as out:
        args = _args(case, out, 2, "gloo")
        kw = dict(model=build_causal_lm("llama"), args=args, train_dataset=dataset(case), data_collator=PadCollator("right"))
        try:
            if what == "cp_size":
                bhf.ContextParallelTrainer(**kw, cp_size=3)
            elif what == "label_smoothing":
                args.label_smoothing_factor = 0.1
                bhf.ContextParallelTrainer(**kw)
            elif what == "bloom":  # its attention never reaches the registered function
                kw["model"] = tf.BloomForCausalLM(tf.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=1, n_head=2))
                bhf.ContextParallelTrainer(**kw)
            elif what == "usp_padding":
                trainer = bhf.ContextParallelTrainer(**kw, strategy="usp", backend="reference",
                                                     strategy_options={"ulysses_degree": world})
                trainer.train()
            else:
                raise AssertionError(what)
        except ValueError as e:
            return str(e)
    return "no error"


def tokenizer():
    """A word-level tokenizer over the ids ``"0" .. str(VOCAB - 1)`` (SFTTrainer needs one; no download)."""
    import transformers as tf
    from tokenizers import Tokenizer, models

    vocab = {str(i): i for i in range(VOCAB)}
    return tf.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="0")),
                                      pad_token="0", eos_token="1")


def sft(rank: int, world: int, context_parallel: bool) -> list:
    """TRL's SFTTrainer, plain (eager, padded, one process) or through ContextParallelMixin (padding-free
    packed rows over the pool): the logged (loss, grad_norm) of 3 steps."""
    import datasets
    import trl

    import burstattn.hf as bhf

    case = TrainerCase()
    model = build_causal_lm("llama", case.seed).train()
    with tempfile.TemporaryDirectory() as out:
        kw = dict(output_dir=out, per_device_train_batch_size=3, max_steps=3, learning_rate=1e-4, logging_steps=1,
                  save_strategy="no", report_to="none", use_cpu=True, seed=0, disable_tqdm=True, bf16=False,
                  max_length=None)
        common = dict(train_dataset=datasets.Dataset.from_list(dataset(case)), processing_class=tokenizer())
        if context_parallel:
            _reset_accelerate(rank, world)

            class SFT(bhf.ContextParallelMixin, trl.SFTTrainer):
                pass

            trainer = SFT(model=model, args=trl.SFTConfig(**kw, padding_free=True, ddp_backend="gloo"), **common,
                          backend="reference")
        else:
            model.set_attn_implementation("eager")
            trainer = trl.SFTTrainer(model=model, args=trl.SFTConfig(**kw), **common)
        trainer.train()
    return [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]


# ---- packed documents and padding (test_hf_packed_batches.py) ------------------------------------
# Every rank builds the same model and data from the seed. References: a packed batch is the same
# documents right-padded with an ``attention_mask`` under eager attention (transformers' own packed path
# does not isolate documents in every version); a padded batch is the same padded batch under eager.


@dataclass(frozen=True)
class PackCase:
    """One packed or padded batch through shard_batch."""

    kind: str = "llama"
    strategy: str = "burst"
    lengths: tuple[int, ...] = (23, 5, 3, 9)  # one longer than a shard, several shorter
    mode: str = "packed"  # packed | flash (cu_seq_lens) | right | left
    layout: Optional[str] = None
    seed: int = 0
    options: tuple = ()

    def id(self) -> str:
        return f"{self.kind}-{self.strategy}-{self.mode}-{'x'.join(map(str, self.lengths))}-{self.layout}"


def documents(case: PackCase) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(case.seed + 11)
    return [torch.randint(1, VOCAB, (n,), generator=gen) for n in case.lengths]


def padded(docs: list[torch.Tensor], side: str, first_label_ignored: bool = True):
    """``input_ids, attention_mask, labels [B, max]``: pads 0, labels -100 at pads (and at each
    document's first token, as DataCollatorWithFlattening marks it, so pads never predict a target)."""
    n = max(d.numel() for d in docs)
    ids = torch.zeros(len(docs), n, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, IGNORE_INDEX)
    for r, d in enumerate(docs):
        sl = slice(0, d.numel()) if side == "right" else slice(n - d.numel(), n)
        ids[r, sl], mask[r, sl], labels[r, sl] = d, 1, d
        if first_label_ignored:
            labels[r, sl.start] = IGNORE_INDEX
    return ids, mask, labels


def _reference(model, docs):
    ids, mask, labels = padded(docs, "right")
    model.set_attn_implementation("eager")
    ref = model(input_ids=ids, attention_mask=mask, labels=labels)
    ref.loss.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    logits = [ref.logits[r, :d.numel()].detach() for r, d in enumerate(docs)]
    return ref.loss.detach(), grads, logits, (ids, mask, labels)


def _errors(model, out, batch, ref_loss, ref_grads, ref_logits, docs, rows_layout) -> dict:
    out.loss.backward()
    bhf.sync_gradients(model)
    full = bhf.gather_logits(out.logits.detach(), shard=batch["burst_shard"])  # [B, N, V]
    if rows_layout == "packed":
        starts = torch.cumsum(torch.tensor([0] + [d.numel() for d in docs]), 0)
        got = [full[0, int(starts[i]):int(starts[i + 1])] for i in range(len(docs))]
    elif rows_layout == "right":
        got = [full[r, :d.numel()] for r, d in enumerate(docs)]
    else:
        got = [full[r, full.shape[1] - d.numel():] for r, d in enumerate(docs)]
    grad_err = max(float((p.grad - ref_grads[k]).abs().max()) for k, p in model.named_parameters())
    return dict(loss=float(out.loss.detach()), ref_loss=float(ref_loss),
                loss_err=float((out.loss.detach() - ref_loss).abs()), grad_err=grad_err,
                logits_err=max(float((g - r).abs().max()) for g, r in zip(got, ref_logits)),
                docs=None if batch["burst_shard"].cu_seqlens is None else batch["burst_shard"].cu_seqlens.numel() - 1)


def pack_or_pad(rank: int, world: int, case: PackCase) -> dict:
    """Loss, gathered logits and summed gradients of a packed (or padded) batch against eager."""
    import transformers as tf

    bhf.register(strategy=case.strategy, layout=case.layout, backend="reference", **dict(case.options))
    model = build_causal_lm(case.kind, case.seed)
    docs = documents(case)
    ref_loss, ref_grads, ref_logits, (ids, mask, labels) = _reference(model, docs)
    model.set_attn_implementation("burst")
    if case.mode in ("packed", "flash"):
        collate = tf.DataCollatorWithFlattening(return_flash_attn_kwargs=case.mode == "flash",
                                                return_position_ids=case.mode == "packed")
        collated = collate([{"input_ids": d.tolist(), "labels": d.tolist()} for d in docs])
        batch = bhf.shard_inputs(collated)
        rows_layout = "packed"
    else:
        ids, mask, labels = padded(docs, case.mode)
        batch = bhf.shard_batch(ids, labels, attention_mask=mask)
        rows_layout = case.mode
    out = model(**batch)
    return _errors(model, out, batch, ref_loss, ref_grads, ref_logits, docs, rows_layout)


def refused(rank: int, world: int, what: str) -> str:
    """One refused combination; every rank must raise. Returns the message (or 'no error')."""
    opts = {"usp": dict(strategy="usp", ulysses_degree=world), "tp": dict(strategy="tp"),
            "rsa": dict(strategy="rsa")}.get(what, dict(strategy="burst"))
    bhf.register(backend="reference", **opts)
    model = build_causal_lm("llama")
    model.set_attn_implementation("burst")
    docs = documents(PackCase(lengths=(12, 5, 9)))
    ids, mask, labels = padded(docs, "right")
    try:
        if what in ("usp", "tp", "rsa"):
            model(**bhf.shard_batch(ids, labels, attention_mask=mask))
        elif what == "hole":
            mask[1, 2] = 0
            bhf.shard_batch(ids, labels, attention_mask=mask)
        elif what == "4d":
            bhf.shard_batch(ids, labels, attention_mask=mask[:, None, None, :].expand(-1, 1, ids.shape[1], -1))
        elif what == "full_batch":  # every rank passes the whole batch, no shard_batch
            model(input_ids=ids, labels=ids)
        elif what == "full_batch_positions":  # ... with its (full) position_ids
            model(input_ids=ids, labels=ids, position_ids=torch.arange(ids.shape[1])[None])
        elif what == "different_batches":  # each rank a different batch (unseeded data)
            bhf.shard_batch(ids + rank, labels)
        else:
            raise AssertionError(what)
    except (ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def layout_mismatch(rank: int, world: int) -> dict:
    """register(layout='striped'); shard_batch without a layout takes it (exact loss); an
    explicit other layout, and a hand-sharded zigzag batch, raise on every rank."""
    from burstattn.layouts.named import local_positions

    bhf.register(strategy="burst", layout="striped", backend="reference")
    model = build_causal_lm("llama")
    ids = torch.randint(0, VOCAB, (2, 8 * world), generator=torch.Generator().manual_seed(5))
    model.set_attn_implementation("eager")
    ref = float(model(input_ids=ids, labels=ids).loss)
    model.set_attn_implementation("burst")
    loss = float(model(**bhf.shard_batch(ids, labels=ids)).loss)
    msgs = []
    try:
        bhf.shard_batch(ids, labels=ids, layout="zigzag")
        msgs.append("no error")
    except ValueError as e:
        msgs.append(str(e))
    pos = local_positions(ids.shape[1], rank, world, "zigzag")
    try:
        model(input_ids=ids[:, pos], position_ids=pos[None].expand(2, -1))
        msgs.append("no error")
    except ValueError as e:
        msgs.append(str(e))
    return dict(loss=loss, ref=ref, messages=msgs)


def padded_generation(rank: int, world: int, kind: str) -> dict:
    """Greedy generation from a left-padded batch of 3 prompts over a ShardedCache against eager."""
    bhf.register(strategy="burst", backend="reference")
    model = build_causal_lm(kind, seed=2)
    docs = documents(PackCase(lengths=(13, 6, 9), seed=3))
    ids, mask, _ = padded(docs, "left")
    model.set_attn_implementation("eager")
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        model.set_attn_implementation("burst")
        out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                             **bhf.cache_kwargs(model, bhf.ShardedCache()))
    return dict(tokens=out, ref=ref)


def sampling(rank: int, world: int, same_seed: bool) -> str:
    """Sampling with per-rank RNG states raises on every rank; equal seeds agree."""
    bhf.register(strategy="burst", backend="reference")
    model = build_causal_lm("llama", seed=4)
    model.set_attn_implementation("burst")
    prompt = torch.randint(0, VOCAB, (1, 11), generator=torch.Generator().manual_seed(9))
    torch.manual_seed(123 if same_seed else 123 + rank)
    try:
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=8, do_sample=True, top_k=0, temperature=5.0,
                                 **bhf.cache_kwargs(model, bhf.ShardedCache()))
    except ValueError as e:
        return f"{type(e).__name__}: {e}"
    return "tokens " + " ".join(map(str, out[0].tolist()))


# ---- dispatch="dynamic" against "static" and world 1 (test_hf_dispatch.py) -----------------------
ADAM_EPS = 1e-6  # the dispatch tests' (tests/dist/test_dispatch.py): Adam's first steps ~ lr * sign(g) at 1e-8


def _trainer(rank: int, world: int, case: TrainerCase, out: str, dispatch: str, data=None, **kw):
    import transformers as tf

    import burstattn.hf as bhf

    _reset_accelerate(rank, world)
    args = _args(case, out, case.per_device, "gloo" if world > 1 else None)
    args.adam_epsilon = ADAM_EPS
    collate = tf.DataCollatorWithFlattening() if case.data == "packed" else PadCollator(case.data)
    return bhf.ContextParallelTrainer(model=build_causal_lm(case.kind, case.seed).train(), args=args, data_collator=collate,
                                      train_dataset=dataset(case) if data is None else data,
                                      strategy=case.strategy, backend="reference", dispatch=dispatch, **kw)


def train(rank: int, world: int, runs: list) -> list[dict]:
    """Each ``(case, dispatch, dynamic's budget or None)``'s 3 steps on this pool: logged losses and grad norms, final parameters,
    the evaluation loss and (dynamic) the last step's sequences per degree."""
    out = []
    for case, dispatch, budget in runs:
        case = replace(case, world=world, cp=world)
        with tempfile.TemporaryDirectory() as d:
            trainer = _trainer(rank, world, case, d, dispatch, **({"dispatch_budget": budget} if budget else {}))
            trainer.train()
            res = _result(trainer, trainer.model)
            res["eval_loss"] = trainer.evaluate(dataset(case)[:4])["eval_loss"]
            plan = trainer.dispatcher.last_plan if trainer.dispatcher else None
            res["degrees"] = None if plan is None else plan.degrees
        out.append(res)
    return out


def dispatch_refusal(rank: int, world: int, what: str) -> str:
    """A refused dynamic configuration or batch: the message on this rank ("no error" if none)."""
    case = TrainerCase(world=world, cp=world)
    with tempfile.TemporaryDirectory() as d:
        try:
            if what == "differing":  # rank 1 holds other tokens: refused at dispatch time, every rank
                data = dataset(replace(case, seed=case.seed + (rank == 1)))
                _trainer(rank, world, case, d, "dynamic", data=data).train()
            elif what == "cp_size":
                _trainer(rank, world, case, d, "dynamic", cp_size=world)
            elif what == "strategy":
                _trainer(rank, world, replace(case, strategy="ulysses"), d, "dynamic")
            elif what == "mode":
                _trainer(rank, world, case, d, "adaptive")
            elif what == "budget":  # a document of 38 tokens over 2 ranks of 8
                _trainer(rank, world, case, d, "dynamic", dispatch_budget=8).train()
            else:
                raise AssertionError(what)
        except ValueError as e:
            return str(e)
    return "no error"

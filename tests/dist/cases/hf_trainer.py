"""Rank-side functions of tests/dist/test_hf_trainer.py: burstattn.hf.ContextParallelTrainer on the
session pools against the plain single-process transformers.Trainer (run in the test process).

Both sides build the same tiny model (hidden 64, 2 layers, seeded) and see the same examples: the plain
Trainer with ``dp * per_device`` rows per step (what accelerate gives ``dp`` processes of ``per_device``
rows between them), eager attention on right- or left-padded rows; the context-parallel one with packed
rows (``DataCollatorWithFlattening``) or the same padded rows.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, replace
from typing import Optional

import torch

from tests.dist.hf_cases import VOCAB, build
from tests.dist.hf_pack_cases import padded

IGNORE = -100
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

    model = build(case.kind, case.seed).train()
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
    model = build(case.kind, case.seed).train()
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


def refusal(rank: int, world: int, what: str) -> str:
    """A refused Trainer configuration: every rank raises; the message."""
    import transformers as tf

    import burstattn.hf as bhf

    _reset_accelerate(rank, world)
    case = TrainerCase(world=world, cp=world)
    with tempfile.TemporaryDirectory() as out:
        args = _args(case, out, 2, "gloo")
        kw = dict(model=build("llama"), args=args, train_dataset=dataset(case), data_collator=PadCollator("right"))
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
    model = build("llama", case.seed).train()
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

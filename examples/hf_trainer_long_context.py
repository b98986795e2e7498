"""Fine-tune a Hugging Face model at long context with burstattn.hf.ContextParallelTrainer.

    # one machine, 2 CPU processes (gloo); every rank holds half of each packed row
    torchrun --nproc-per-node 2 examples/hf_trainer_long_context.py
    # the same through TRL's SFTTrainer (pip install 'burstattn[trl]')
    torchrun --nproc-per-node 2 examples/hf_trainer_long_context.py --trl
    # 2 replicas x 2 context-parallel ranks
    torchrun --nproc-per-node 4 examples/hf_trainer_long_context.py --cp-size 2
    # GPUs: accelerate launch --multi_gpu --num_processes 8 examples/hf_trainer_long_context.py --cp-size 4

A small Llama-architecture model built from a config (random weights: no download) learns synthetic
long documents (each counts up with its own stride, so a token follows from the two before it; lengths
long-tailed, some longer than a shard, many short). DataCollatorWithFlattening packs each batch into one
row with position_ids restarting per document; the Trainer cuts every row over the context-parallel
ranks with a document-balanced partition, no token attends across a document, and the logged loss is
the single-process loss. The change from a plain Trainer script is three lines (marked "burstattn").
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist
import transformers

import burstattn.hf as bhf  # burstattn (1/3)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=int, default=192, help="training documents")
    p.add_argument("--max-doc-len", type=int, default=2048, help="longest document (tokens)")
    p.add_argument("--batch", type=int, default=8, help="documents packed into one row per replica")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--cp-size", type=int, default=None, help="ranks per sequence (default: all)")
    p.add_argument("--strategy", default="burst")
    p.add_argument("--trl", action="store_true", help="TRL's SFTTrainer through ContextParallelMixin")
    return p.parse_args()


def documents(n: int, max_len: int, vocab: int, seed: int = 0) -> list[dict]:
    """``n`` documents, lengths long-tailed in [16, max_len]: each counts up from a random start with its
    own stride (1-4) modulo the vocabulary, so a token follows from the two before it."""
    gen = torch.Generator().manual_seed(seed)
    lengths = (16 * torch.exp(torch.rand(n, generator=gen) * torch.log(torch.tensor(max_len / 16)))).long()
    docs = []
    for length in lengths.tolist():
        start, stride = (int(torch.randint(0, vocab, (1,), generator=gen)), int(torch.randint(1, 5, (1,), generator=gen)))
        docs.append({"input_ids": ((start + stride * torch.arange(length)) % vocab).tolist()})
    return docs


def model_from_config() -> transformers.PreTrainedModel:
    torch.manual_seed(0)  # the same random weights on every rank
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192)
    return transformers.LlamaForCausalLM(cfg)


def trainer(args, model, data, out: str):
    cpu_group = not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1
    common = dict(output_dir=out, per_device_train_batch_size=args.batch, max_steps=args.steps, learning_rate=3e-3,
                  logging_steps=4, save_strategy="no", report_to="none", use_cpu=not torch.cuda.is_available(),
                  ddp_backend="gloo" if cpu_group else None, disable_tqdm=True, seed=0)
    cp = dict(cp_size=args.cp_size, strategy=args.strategy)  # burstattn (2/3): the context-parallel options
    if args.trl:
        import datasets
        import trl
        from tokenizers import Tokenizer, models

        vocab = {str(i): i for i in range(model.config.vocab_size)}
        tok = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="0")),
                                                   pad_token="0", eos_token="1")

        class SFT(bhf.ContextParallelMixin, trl.SFTTrainer):  # burstattn (3/3), TRL flavour
            pass

        return SFT(model=model, args=trl.SFTConfig(**common, padding_free=True, max_length=None, bf16=False),
                   train_dataset=datasets.Dataset.from_list(data), processing_class=tok, **cp)
    # burstattn (3/3): ContextParallelTrainer instead of transformers.Trainer
    return bhf.ContextParallelTrainer(model=model, args=transformers.TrainingArguments(**common), train_dataset=data,
                                      data_collator=transformers.DataCollatorWithFlattening(), **cp)


def main() -> None:
    args = parse()
    model = model_from_config()
    data = documents(args.docs, args.max_doc_len, model.config.vocab_size)
    with tempfile.TemporaryDirectory() as out:
        t = trainer(args, model, data, out)
        t0 = time.perf_counter()
        t.train()
        elapsed = time.perf_counter() - t0
    losses = [h["loss"] for h in t.state.log_history if "loss" in h and "train_loss" not in h]
    tokens = sum(len(d["input_ids"]) for d in data[:args.steps * args.batch * t.dp_size])
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"world {dist.get_world_size() if dist.is_initialized() else 1} (dp {t.dp_size} x cp {t.cp_size}), "
              f"strategy {args.strategy}{', TRL SFTTrainer' if args.trl else ''}: logged losses "
              f"{[round(x, 3) for x in losses]}; {tokens / elapsed:.0f} tokens/s")
    ok = len(losses) >= 2 and losses[-1] < losses[0]
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()

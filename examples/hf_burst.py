"""A transformers model with attn_implementation="burst" over every rank of a torchrun job.

    # one machine, 2 CPU processes (gloo):
    torchrun --nproc-per-node 2 examples/hf_burst.py
    # a model saved with save_pretrained (a local directory, no download):
    torchrun --nproc-per-node 2 examples/hf_burst.py --model DIR

One sequence-parallel training step (each rank holds its zigzag shard of the sequence: the loss is
the single-process loss, the summed gradients the single-process gradients), then greedy
generation over a KV cache that stays sharded. Rank 0 prints both and checks them against the
eager model on one process (every rank has the whole batch, so the check needs no communication).
Needs ``pip install 'burstattn[hf]'``.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import transformers

import burstattn.hf as bhf


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a save_pretrained directory (default: a small random Llama)")
    p.add_argument("--seq-len", type=int, default=250, help="training sequence length (any length: right-padded)")
    p.add_argument("--strategy", default="burst")
    p.add_argument("--new-tokens", type=int, default=8)
    return p.parse_args()


def load(args) -> transformers.PreTrainedModel:
    if args.model is not None:
        return transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    torch.manual_seed(0)  # the same random weights on every rank
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    return transformers.LlamaForCausalLM(cfg)


def main() -> None:
    args = parse()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    bhf.register("burst", strategy=args.strategy)  # before the model selects it
    model = load(args).float()
    ids = torch.randint(0, model.config.vocab_size, (1, args.seq_len), generator=torch.Generator().manual_seed(1))

    model.set_attn_implementation("burst")
    batch = bhf.shard_batch(ids, labels=ids)  # this rank's input_ids, global position_ids, shifted labels
    loss = model(**batch).loss  # the single-process loss on every rank
    loss.backward()
    bhf.sync_gradients(model)  # now the single-process gradients
    grads = [p.grad.clone() for p in model.parameters()]
    prompt = ids[:, :37]
    with torch.no_grad():
        tokens = model.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False,
                                **bhf.cache_kwargs(model, bhf.ShardedCache()))  # `cache=` on transformers >= 5.24

    model.zero_grad(set_to_none=True)
    model.set_attn_implementation("eager")  # the reference: one process, the whole sequence
    ref = model(input_ids=ids, labels=ids).loss
    ref.backward()
    grad_err = max(float((g - p.grad).abs().max()) for g, p in zip(grads, model.parameters()))
    with torch.no_grad():
        ref_tokens = model.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False)
    if rank == 0:
        print(f"world {dist.get_world_size()}, strategy {args.strategy}: loss {loss.item():.6f} "
              f"(eager {ref.item():.6f}), largest gradient difference {grad_err:.2e}")
        print(f"generated {tokens[0, prompt.shape[1]:].tolist()} "
              f"({'same as' if torch.equal(tokens, ref_tokens) else 'DIFFERENT from'} eager)")
    dist.destroy_process_group()
    raise SystemExit(0 if torch.equal(tokens, ref_tokens) and grad_err < 1e-4 else 1)


if __name__ == "__main__":
    main()

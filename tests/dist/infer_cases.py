"""Rank-side functions of tests/dist/test_infer.py (module-level so they pickle by reference).

Every rank builds the ``tiny`` model from the same seed and the same prompts; the parent compares
with :func:`reference_tokens` (single process, the whole sequence recomputed every step, no cache).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import burstattn
from burstattn.infer.generate import continue_generation, generate
from burstattn.infer.steps import decode_step
from burstattn.models import AttnCall, Llama, preset

VOCAB = 256


@dataclass(frozen=True)
class GenCase:
    """A prefill strategy at a world size, a prompt length, a continuation mode."""

    world: int
    strategy: str = "burst"
    prompt_len: int = 13
    new_tokens: int = 5
    more_len: int = 9
    more_tokens: int = 4
    continuation: str = "auto"
    batch: int = 2
    seed: int = 0

    def id(self) -> str:
        return f"w{self.world}-{self.strategy}-n{self.prompt_len}-m{self.more_len}-{self.continuation}"


def tiny_model(seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    return Llama(preset("tiny"), attn=AttnCall(strategy="burst", layout="contiguous",
                                               options=dict(backend="reference"))).eval()


def prompts(case: GenCase) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(case.seed + 100)
    return (torch.randint(0, VOCAB, (case.batch, case.prompt_len), generator=gen),
            torch.randint(0, VOCAB, (case.batch, case.more_len), generator=gen))


@torch.no_grad()
def reference_tokens(case: GenCase) -> tuple[torch.Tensor, torch.Tensor]:
    """Single-process greedy tokens: ``new_tokens`` after the prompt, then ``more_tokens`` after the
    second prompt, recomputing the whole sequence each step."""
    model = tiny_model(case.seed)
    prompt, more = prompts(case)
    seq, turns = prompt, []
    for extra, count in ((None, case.new_tokens), (more, case.more_tokens)):
        if extra is not None:
            seq = torch.cat([seq, extra], dim=1)
        out = []
        for _ in range(count):
            token = model(seq, torch.arange(seq.shape[1]))[:, -1].argmax(-1)
            out.append(token)
            seq = torch.cat([seq, token[:, None]], dim=1)
        turns.append(torch.stack(out, dim=1))
    return turns[0], turns[1]


def sent_by_op(stats) -> dict:
    return {op: row["sent"] for ops in stats.as_dict().values() for op, row in ops.items()}


def generate_and_continue(rank: int, world: int, case: GenCase) -> dict:
    """Prefill + decode, one decode step under the byte meter, then a continuation under it."""
    model = tiny_model(case.seed)
    prompt, more = prompts(case)
    first = generate(model, prompt, case.new_tokens, strategy=case.strategy, backend="reference")
    probe = generate(model, prompt, 1, strategy=case.strategy, backend="reference")  # the prefill alone
    lengths_after_prefill = probe.cache.lengths
    with burstattn.comm_stats() as stats:
        decode_step(model, probe.tokens[:, -1], probe.cache, backend="reference")
    decode_sent = sent_by_op(stats)
    cache_before = first.cache.lengths
    with burstattn.comm_stats() as stats:
        second = continue_generation(model, first, more, case.more_tokens, continuation=case.continuation,
                                     backend="reference")
    return dict(tokens=first.tokens, more=second.tokens, mode=second.continuations[0], decode_sent=decode_sent,
                continuation_sent=sent_by_op(stats), lengths_before=cache_before, lengths=second.cache.lengths,
                lengths_after_prefill=lengths_after_prefill, local_bytes=second.cache.local_bytes())


def budget_run(rank: int, world: int, prompt_len: int, budget: int) -> dict:
    """``generate`` under a K/V budget per rank: tokens, or the error message."""
    model = tiny_model(0)
    prompt = prompts(GenCase(world, prompt_len=prompt_len))[0]
    try:
        res = generate(model, prompt, 3, kv_budget_bytes=budget, backend="reference")
    except ValueError as e:
        return dict(error=str(e))
    return dict(tokens=res.tokens, local_bytes=res.cache.local_bytes())


def bad_input(rank: int, world: int, what: str) -> str:
    """One kind of bad input (on one rank, or differing between ranks); returns the error message."""
    model = tiny_model(0)
    prompt = prompts(GenCase(world))[0]
    max_new = 3
    if what == "empty" and rank == world - 1:
        prompt = prompt[:, :0]
    elif what == "negative":
        max_new = -1
    elif what == "differ" and rank == 0:
        prompt = prompt.clone()
        prompt[0, 0] += 1
    elif what == "differ_len" and rank == world - 1:
        prompt = prompt[:, :-1]
    try:
        generate(model, prompt, max_new, backend="reference")
    except ValueError as e:
        return str(e)
    return "no error"

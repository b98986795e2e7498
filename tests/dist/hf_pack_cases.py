"""Rank-side functions of tests/dist/test_hf_packing.py: packed documents, padding, refusals and
the silent wrong answers of the HF path, each against the eager single-process transformers model.

Every rank builds the same model and data from the seed. References: a packed batch is the same
documents right-padded with an ``attention_mask`` under eager attention (transformers' own packed path
does not isolate documents in every version); a padded batch is the same padded batch under eager.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

import burstattn.hf as bhf
from burstattn.config import IGNORE_INDEX
from tests.dist.hf_cases import VOCAB, build


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
    model = build(case.kind, case.seed)
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
    model = build("llama")
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
    model = build("llama")
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
    model = build(kind, seed=2)
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
    model = build("llama", seed=4)
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

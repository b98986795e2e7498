"""Rank-side function of tests/dist/test_hf_loss.py (module level, so it pickles by reference)."""
from __future__ import annotations

import torch


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

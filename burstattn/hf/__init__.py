"""Hugging Face transformers integration (optional extra ``burstattn[hf]``: ``transformers>=5,<6``).

* :func:`register` — ``attn_implementation="burst"`` for any model that dispatches through
  transformers' attention interface (Llama, Qwen2/3, Mistral, ...), with its mask function
  (a padding mask handed straight to the model is refused with a clear error, never dropped).
* :func:`shard_batch`, :func:`shard_inputs`, :func:`sync_gradients`, :func:`gather_logits` —
  sequence-parallel training and scoring, packed documents and padding included: loss, gradients and
  logits equal the single-process model's.
* :class:`ShardedCache` — generation over a KV cache that stays sharded across the ranks.
* the model families of today (:mod:`.families`: Gemma 2's softcap, gpt-oss's sinks, DeepSeek-V3's
  MLA head sizes, T5Gemma's encoder and cross-attention; :func:`check_model` refuses a model whose
  attention would not reach burstattn) and :func:`shard_seq2seq_batch` for encoder-decoder models.
* hybrid models (:func:`patch_mixers`, :mod:`.hybrid`): Gated DeltaNet, KDA, Mamba2, lightning attention
  and short-convolution mixers made sequence parallel (state passing, conv halos), exactly.
* :class:`ContextParallelTrainer`, :class:`ContextParallelMixin` — ``transformers.Trainer`` (or any
  subclass, e.g. TRL's ``SFTTrainer``) over a ``dp x cp`` mesh (imported on first use: they need
  ``accelerate``, as the Trainer does).

Importing :mod:`burstattn` never imports transformers; importing this package does.
"""
from __future__ import annotations

import sys

try:
    import transformers  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("burstattn.hf needs transformers 5.x: pip install 'burstattn[hf]'") from e

from .attention import BurstMask, Registration, register
from .batch import GlobalItemCount, ShardSpec, gather_logits, shard_batch, shard_inputs, sync_gradients
from .cache import ShardedCache, cache_kwargs
from .families import check_model
from .hybrid import patch_mixers
from .survey import sequence_mixers
from .seq2seq import shard_seq2seq_batch
from .loss import causal_lm_loss  # noqa: F401  (the blockwise loss, burstattn/hf/loss.py)

__all__ = ["register", "shard_batch", "shard_inputs", "sync_gradients", "gather_logits", "ShardedCache",
           "cache_kwargs", "Registration", "BurstMask", "GlobalItemCount", "ShardSpec", "ContextParallelTrainer",
           "ContextParallelMixin", "check_model", "sequence_mixers", "patch_mixers", "shard_seq2seq_batch"]


def __getattr__(name: str):
    if name in ("ContextParallelTrainer", "ContextParallelMixin"):
        from . import trainer

        return getattr(trainer, name)
    # names that moved out of this module (the table burstattn.MOVED): resolved, or refused with the new spelling
    return sys.modules["burstattn"].moved_attribute(__name__, name)

"""Hugging Face transformers integration (optional extra ``burstattn[hf]``: ``transformers>=5,<6``).

* :func:`register` — ``attn_implementation="burst"`` for any model that dispatches through
  transformers' attention interface (Llama, Qwen2/3, Mistral, ...), with its mask function
  (padding masks are refused with a clear error, never dropped).
* :func:`shard_batch`, :func:`sync_gradients`, :func:`gather_logits` — sequence-parallel
  training and scoring: loss, gradients and logits equal the single-process model's.
* :class:`ShardedCache` — generation over a KV cache that stays sharded across the ranks.
* the model families of today (:mod:`.families`: Gemma 2's softcap, gpt-oss's sinks, DeepSeek-V3's
  MLA head sizes, T5Gemma's encoder and cross-attention; :func:`check_model` refuses a model whose
  attention would not reach burstattn) and :func:`shard_seq2seq_batch` for encoder-decoder models.

Importing :mod:`burstattn` never imports transformers; importing this package does.
"""
from __future__ import annotations

try:
    import transformers  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("burstattn.hf needs transformers 5.x: pip install 'burstattn[hf]'") from e

from .attention import BurstMask, BurstOptions, register
from .batch import GlobalItemCount, gather_logits, shard_batch, sync_gradients
from .cache import ShardedCache
from .families import check_model
from .seq2seq import shard_seq2seq_batch

__all__ = ["register", "shard_batch", "sync_gradients", "gather_logits", "ShardedCache", "BurstOptions",
           "BurstMask", "GlobalItemCount", "check_model", "shard_seq2seq_batch"]

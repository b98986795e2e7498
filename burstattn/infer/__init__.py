"""Inference over a sharded KV cache: sharded prefill, decoding, continuation, generation."""

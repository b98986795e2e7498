"""LLaMA-style models for sequence-parallel training and inference (configs, presets, the model)."""
from .config import PRESETS, LlamaConfig, preset
from .llama import Attention, AttnCall, FeedForward, Llama, TransformerBlock
from .norms import RMSNorm
from .rope import apply_rotary

__all__ = ["LlamaConfig", "PRESETS", "preset", "Llama", "AttnCall", "Attention", "FeedForward",
           "TransformerBlock", "RMSNorm", "apply_rotary"]

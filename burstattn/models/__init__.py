"""LLaMA-style models for sequence-parallel training and inference (configs and presets)."""
from .config import PRESETS, LlamaConfig, preset

__all__ = ["LlamaConfig", "PRESETS", "preset"]

"""LLaMA-style models for sequence-parallel training and inference (configs, presets, the model,
the blockwise MLP and loss, checkpointing and offload)."""
from .blockwise import IGNORE, auto_chunks, blockwise_cross_entropy, chunk_bounds
from .checkpointing import CHECKPOINTING, LayerRun
from .config import PRESETS, LlamaConfig, preset
from .llama import Attention, AttnCall, FeedForward, Llama, LossOutput, TransformerBlock
from .norms import RMSNorm
from .offload import OFFLOAD, HostOffload
from .rope import apply_rotary

__all__ = ["LlamaConfig", "PRESETS", "preset", "Llama", "AttnCall", "Attention", "FeedForward",
           "TransformerBlock", "RMSNorm", "apply_rotary", "LossOutput", "LayerRun", "CHECKPOINTING", "OFFLOAD",
           "HostOffload", "IGNORE", "auto_chunks", "blockwise_cross_entropy", "chunk_bounds"]

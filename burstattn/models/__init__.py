"""LLaMA-style models for sequence-parallel training and inference (configs, presets, the model,
the blockwise MLP and loss, checkpointing and offload)."""
import sys

from .blockwise import auto_chunks, blockwise_cross_entropy, chunk_bounds
from .checkpointing import CHECKPOINTING, LayerRun
from .config import PRESETS, HybridConfig, LlamaConfig, preset
from .hybrid import GatedDeltaNet, HybridLlama, model_class
from .llama import Attention, AttnCall, FeedForward, Llama, LossOutput, TransformerBlock
from .norms import RMSNorm
from .offload import OFFLOAD, HostOffload
from .rope import apply_rotary

__all__ = ["LlamaConfig", "HybridConfig", "HybridLlama", "GatedDeltaNet", "model_class", "PRESETS", "preset", "Llama", "AttnCall", "Attention", "FeedForward",
           "TransformerBlock", "RMSNorm", "apply_rotary", "LossOutput", "LayerRun", "CHECKPOINTING", "OFFLOAD",
           "HostOffload", "auto_chunks", "blockwise_cross_entropy", "chunk_bounds"]


def __getattr__(name: str):
    # names that moved out of this module (the table burstattn.MOVED): resolved, or refused with the new spelling
    return sys.modules["burstattn"].moved_attribute(__name__, name)

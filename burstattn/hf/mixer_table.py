"""The table of transformers' sequence mixers (non-attention token mixers of hybrid models): which
ones burstattn makes sequence parallel (:mod:`.hybrid`) and why the others are refused. Data only, by
class name (checked against transformers 5.24), so that the survey's messages can read it without
importing the adapters.

Each supported class maps to ``(model_type, recurrence)``, the recurrence one of :mod:`burstattn.recurrent`'s:
``"gdn"`` (Gated DeltaNet: conv + gated delta rule), ``"kda"`` (Kimi delta attention: conv + per-channel
decay), ``"ssd"`` (Mamba2: conv + state-space duality scan), ``"lightning"`` (MiniMax's constant-decay linear
attention), ``"conv"`` (LFM2's gated short convolution).
"""
from __future__ import annotations

PATCHED = "_burstattn_sequence_parallel"  # on a patched module instance: its recurrence ("gdn", "ssd", ...)

SUPPORTED = {
    "Qwen3NextGatedDeltaNet": ("qwen3_next", "gdn"),
    "Qwen3_5GatedDeltaNet": ("qwen3_5", "gdn"),
    "Qwen3_5MoeGatedDeltaNet": ("qwen3_5_moe", "gdn"),
    "OlmoHybridGatedDeltaNet": ("olmo_hybrid", "gdn"),
    "KimiLinearDeltaAttention": ("kimi_linear", "kda"),
    "BambaMixer": ("bamba", "ssd"),
    "GraniteMoeHybridMambaLayer": ("granitemoehybrid", "ssd"),
    "NemotronHMamba2Mixer": ("nemotron_h", "ssd"),
    "FalconH1Mixer": ("falcon_h1", "ssd"),
    "MiniMaxLightningAttention": ("minimax", "lightning"),
    "Lfm2ShortConv": ("lfm2", "conv"),
    "Lfm2MoeShortConv": ("lfm2_moe", "conv"),
}

# known mixers that stay refused, with the reason (a class in neither table is refused as unclassified)
REFUSED = {
    "JambaMambaMixer": "Mamba (v1)'s selective scan decays every (channel, state) pair on its own: not a scalar "
                       "or per-key-channel decay that burstattn.recurrent passes between ranks",
    "MambaMixer": "Mamba (v1)'s selective scan (a decay per channel and state)",
    "FalconMambaMixer": "Mamba (v1)'s selective scan (a decay per channel and state)",
    "Zamba2MambaMixer": "Zamba2's Mamba2 mixer is not yet adapted (its layers share blocks)",
    "Mamba2Mixer": "pure Mamba2 models have no attention layer to shard with burstattn",
    "RecurrentGemmaRecurrentBlock": "RG-LRU (a per-channel gated recurrence) is not yet adapted",
    "RecurrentGemmaRglru": "RG-LRU (a per-channel gated recurrence) is not yet adapted",
}


def hint(class_name: str) -> str:
    """What to do about one refused mixer class: patch it, or why it stays refused ('' if unknown)."""
    if class_name in SUPPORTED:
        return f"{class_name} is sequence parallel after burstattn.hf.patch_mixers(model)"
    if class_name in REFUSED:
        return f"{class_name}: {REFUSED[class_name]}"
    return ""


__all__ = ["PATCHED", "SUPPORTED", "REFUSED", "hint"]

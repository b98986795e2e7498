"""Sequence-parallel linear recurrences and short convolutions (hybrid models' non-attention layers).

Exact state passing across ranks (:mod:`.passing`; the all-gather or the log-depth scan,
:mod:`.schemes`, :mod:`.scan`), causal convolution halos (:mod:`.conv`), the
chunked single-process forms (:mod:`.chunked`) and the families' recurrences (:mod:`.families`).
Imports only torch and burstattn's bottom layers (layout, partition, groups, comm).
"""
from .bytes import conv_halo_bytes, state_passing_bytes, state_passing_steps
from .chunked import chunk_delta_rule, chunk_linear_attention, recurrent_reference
from .conv import sp_causal_conv1d
from .families import sp_kda, sp_lightning_attention, sp_ssd
from .passing import sp_gated_delta_rule, sp_linear_attention
from .schemes import SCAN_MIN_WORLD

__all__ = ["sp_gated_delta_rule", "sp_linear_attention", "sp_causal_conv1d", "sp_ssd", "sp_lightning_attention",
           "sp_kda", "chunk_delta_rule", "chunk_linear_attention", "recurrent_reference", "state_passing_bytes",
           "state_passing_steps", "conv_halo_bytes", "SCAN_MIN_WORLD"]

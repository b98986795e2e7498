"""burstattn: exact attention over sequences sharded across the ranks of a process group.

Importing this package only imports torch; nothing runs at import time.
"""
from .api import BurstAttention, burst_attn_func
from .comm.stats import CommStats, comm_stats
from .formulas import ring_bytes
from .strategies import attention
from .layout import gather_sequence, sequence_positions, shard_sequence
from .groups import two_level_groups
from .masks import AttnMask
from .partition import Partition, document_partition
from .trace import StepTrace, trace_steps

__version__ = "0.1.0"

__all__ = ["attention", "burst_attn_func", "BurstAttention", "shard_sequence", "gather_sequence",
           "sequence_positions", "comm_stats", "CommStats", "trace_steps", "StepTrace",
           "ring_bytes", "AttnMask", "Partition", "document_partition", "two_level_groups",
           "__version__"]

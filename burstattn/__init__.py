"""burstattn: exact attention over sequences sharded across the ranks of a process group.

Importing this package imports nothing but the standard library: every public name below is
imported on first use (PEP 562), so ``burstattn --help`` answers without loading torch, and
``import burstattn`` then ``burstattn.attention`` imports torch and the core only. Nothing runs
at import time.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> the module that defines it (relative to this package)
_EXPORTS = {
    "BurstAttention": ".api", "burst_attn_func": ".api", "BurstOptions": ".options",
    "CommStats": ".comm.stats", "comm_stats": ".comm.stats",
    "ring_bytes": ".formulas",
    "attention": ".strategies",
    "gather_sequence": ".layout", "sequence_positions": ".layout", "shard_sequence": ".layout",
    "two_level_groups": ".groups",
    "AttnMask": ".masks",
    "Partition": ".partition", "document_partition": ".partition", "mask_partition": ".partition_solver",
    "StepTrace": ".comm.trace", "trace_steps": ".comm.trace",
}

# modules renamed: the old name is refused with the new one (outside code may import it)
_RENAMED = {"autograd": "passes (the engine's adapter: kernel choice, positions and passes)"}

__all__ = ["attention", "burst_attn_func", "BurstAttention", "BurstOptions", "shard_sequence", "gather_sequence",
           "sequence_positions", "comm_stats", "CommStats", "trace_steps", "StepTrace",
           "ring_bytes", "AttnMask", "Partition", "document_partition", "mask_partition", "two_level_groups",
           "__version__"]


def __getattr__(name: str):
    """Import a public name (or a submodule, e.g. ``burstattn.ops``) on first use."""
    if name in _RENAMED:
        raise AttributeError(f"burstattn.{name} is now burstattn.{_RENAMED[name]}")
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    else:
        try:
            value = importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from .api import BurstAttention, burst_attn_func  # noqa: F401
    from .options import BurstOptions  # noqa: F401
    from .comm.stats import CommStats, comm_stats  # noqa: F401
    from .formulas import ring_bytes  # noqa: F401
    from .groups import two_level_groups  # noqa: F401
    from .layout import gather_sequence, sequence_positions, shard_sequence  # noqa: F401
    from .masks import AttnMask  # noqa: F401
    from .partition import Partition, document_partition  # noqa: F401
    from .partition_solver import mask_partition  # noqa: F401
    from .strategies import attention  # noqa: F401
    from .comm.trace import StepTrace, trace_steps  # noqa: F401

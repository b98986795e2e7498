"""Metered collectives over an explicit group (all-to-all, all-gather, reduce-scatter).

Every call records into a :class:`~burstattn.comm.stats.CommStats` (when one is given) the
bytes this rank must put on the wire for that collective, whatever algorithm the backend
picks: all-to-all ``(P-1)/P`` of its input; all-gather ``(P-1)`` times its input (every
other rank needs this rank's shard); reduce-scatter ``(P-1)/P`` of its input. Received
bytes are the same by symmetry. Tensors are split and joined along dim 0. (The
``*_single`` collectives of newer PyTorch are used where they exist: the ``*_tensor`` names
are deprecated there.)
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .errors import CollectiveError
from .stats import CommStats


class Collectives:
    """Collectives on ``group`` that meter bytes under ``(phase, op)``.

    Args:
        group: the process group (explicit; ``dist.group.WORLD`` for the world).
        phase: ``"forward"`` or ``"backward"`` (the meter's phase label).
        stats: the byte meter, or ``None``.
    """

    def __init__(self, group: dist.ProcessGroup, phase: str, stats: Optional[CommStats] = None) -> None:
        self.group, self.phase, self.stats = group, phase, stats
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def _record(self, op: str, nbytes: int) -> None:
        if self.stats is not None:
            self.stats.record(self.phase, op, nbytes, nbytes)

    def _run(self, op: str, fn, *args) -> None:
        try:
            fn(*args, group=self.group)
        except RuntimeError as e:
            raise CollectiveError(f"rank {self.rank}: {self.phase} {op!r} collective failed (a rank died, "
                                  f"hung past the process group's timeout, or the link broke): {e}") from e

    def all_to_all(self, x: torch.Tensor, op: str) -> torch.Tensor:
        """``x [P, ...]``: chunk ``j`` goes to rank ``j``; returns ``[P, ...]`` with chunk ``i``
        from rank ``i``."""
        x = x.contiguous()
        out = torch.empty_like(x)
        self._run(op, dist.all_to_all_single, out, x)
        self._record(op, x.numel() * x.element_size() * (self.world_size - 1) // self.world_size)
        return out

    def all_gather(self, x: torch.Tensor, op: str, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x [...]`` -> ``[P, ...]`` with entry ``i`` from rank ``i``. ``out``: a contiguous buffer of
        ``P * x.numel()`` elements to gather into (default: a new one)."""
        flat = x.reshape(-1)  # the backends gather along dim 0 of flat buffers: (P * numel,)
        if out is None:
            out = torch.empty(self.world_size * flat.numel(), dtype=x.dtype, device=x.device)
        out = out.view(-1)
        self._run(op, getattr(dist, "all_gather_single", dist.all_gather_into_tensor), out, flat)
        self._record(op, x.numel() * x.element_size() * (self.world_size - 1))
        return out.view((self.world_size,) + tuple(x.shape))  # (P * numel,) -> (P, ...)

    def reduce_scatter(self, x: torch.Tensor, op: str) -> torch.Tensor:
        """``x [P, ...]`` -> ``[...]``: the sum over ranks of their chunk ``rank``."""
        flat = x.reshape(-1)  # (P, ...) -> (P * m,): chunk j of the flat buffer is x[j]
        out = torch.empty(flat.numel() // self.world_size, dtype=x.dtype, device=x.device)
        self._run(op, getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor), out, flat)
        self._record(op, x.numel() * x.element_size() * (self.world_size - 1) // self.world_size)
        return out.view(tuple(x.shape[1:]))

"""The transport of the one loop: paired, batched point-to-point transfers with any peer of a group,
with a strict life cycle.

Life cycle per channel (a named stream of transfers, e.g. ``"kv"`` or ``"dq"``): :meth:`Transport.queue`
queues one send or receive with a peer, :meth:`Transport.commit` posts everything queued as ONE
``batch_isend_irecv`` (a plan queues every send together with its receive on the peer in the same
step: no asymmetric lists, no hang), :meth:`Transport.wait` blocks until the channel's transfers are
done. Misuse (committing nothing, waiting on nothing, queueing on a channel still in flight) raises
``RuntimeError``. Each channel has its own tag so that two channels in flight between the same pair of
ranks never match each other's messages. No device-wide synchronisation is done: waiting is per
transfer. Every transfer is metered (:class:`~.stats.CommStats`) and traced (:class:`~.trace.StepTrace`)
where it is queued and posted.

A neighbour ring is a plan, not a transport: :func:`burstattn.engine.plan.ring` names the peers
``r + 1`` and ``r - 1`` of every step, and the loop queues those moves here like any others.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from .errors import RingCommError
from .groups import GroupContext
from .stats import CommStats
from .trace import StepTrace, now_ns


class Transport:
    """Point-to-point transfers with any rank of ``group``.

    Args:
        group: the process group (required; pass ``dist.group.WORLD`` for the world).
        phase: label for the byte meter and the trace (``"forward"``/``"backward"``).
        stats, trace: where to record bytes and events (either may be ``None``).
    """

    def __init__(self, group: dist.ProcessGroup, phase: str,
                 stats: Optional[CommStats] = None, trace: Optional[StepTrace] = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.phase, self.stats, self.trace = phase, stats, trace
        self._queued: dict[str, list[dist.P2POp]] = {}
        self._inflight: dict[str, list] = {}
        self._peers: dict[str, set] = {}
        self._tags: dict[str, int] = {}

    def _tag(self, channel: str) -> int:
        return self._tags.setdefault(channel, len(self._tags) + 1)

    def open_channels(self, channels: list[str]) -> None:
        """Give ``channels`` their tags in this order. Call it with the same list on every rank
        before the first transfer when ranks may use different channels first (direct schedules)."""
        for c in channels:
            self._tag(c)

    def queue(self, channel: str, kind: str, tensor: torch.Tensor, peer: int, op: str) -> None:
        """Queue one transfer with a rank of the group: ``kind`` ``"send"`` or ``"recv"``, ``peer`` a
        group rank, ``op`` the meter's label. ``tensor`` must not be touched until :meth:`wait`."""
        if channel in self._inflight:
            raise RuntimeError(f"channel {channel!r} still has transfers in flight; wait() first")
        if kind not in ("send", "recv") or not 0 <= peer < self.world_size or peer == self.rank:
            raise RuntimeError(f"queue: bad transfer {kind!r} with peer {peer} on rank {self.rank}")
        fn = dist.isend if kind == "send" else dist.irecv
        self._queued.setdefault(channel, []).append(
            dist.P2POp(fn, tensor, dist.get_global_rank(self.group, peer), self.group, self._tag(channel)))
        self._peers.setdefault(channel, set()).add(peer)
        if self.stats is not None:
            nbytes = tensor.numel() * tensor.element_size()
            self.stats.record(self.phase, op, nbytes if kind == "send" else 0, nbytes if kind == "recv" else 0)

    def commit(self, channel: str, step: int = -1) -> None:
        """Post the queued transfers of ``channel`` as one batch (nothing queued raises)."""
        ops = self._queued.pop(channel, None)
        if not ops:
            raise RuntimeError(f"commit: nothing queued on channel {channel!r}")
        try:
            self._inflight[channel] = dist.batch_isend_irecv(ops)
        except RuntimeError as e:
            raise self._failure(channel, step, e) from e
        if self.trace is not None:
            self.trace.record("post", self.phase, channel, step, self.rank, now_ns())

    def wait(self, channel: str, step: int = -1) -> None:
        """Block until ``channel``'s transfers are complete (raises on a peer failure or timeout;
        nothing in flight raises)."""
        works = self._inflight.pop(channel, None)
        if works is None:
            raise RuntimeError(f"wait: nothing in flight on channel {channel!r}")
        t0 = now_ns()
        try:
            for w in works:
                w.wait()
        except RuntimeError as e:
            raise self._failure(channel, step, e) from e
        self._peers.pop(channel, None)
        if self.trace is not None:
            self.trace.record("wait", self.phase, channel, step, self.rank, t0, now_ns())

    def _failure(self, channel: str, step: int, err: Exception) -> RingCommError:
        peers = sorted(dist.get_global_rank(self.group, p) for p in self._peers.get(channel, ()))
        return RingCommError(
            f"rank {self.rank}: {self.phase} ring transfer on channel {channel!r} at step {step} "
            f"failed (a peer among ranks {peers} died, hung past the process group's timeout, or the "
            f"link broke): {err}")

    def pending(self) -> bool:
        """Whether anything is queued or in flight."""
        return bool(self._queued or self._inflight)


@dataclass
class TwoLevel:
    """The inner and outer transports of a nested plan (``None`` for a level of size 1)."""

    inner: Optional[Transport]
    outer: Optional[Transport]


def pass_transport(ctx: GroupContext, phase: str, stats: Optional[CommStats], trace: Optional[StepTrace],
                   topology=None):
    """A fresh transport for one pass over ``ctx``'s group (``None`` for a world of one); with a
    ``topology`` (:class:`~burstattn.comm.groups.TwoLevelGroups`, schedule "double") the inner and outer
    transports (:class:`TwoLevel`)."""
    if ctx.world_size == 1:
        return None
    if topology is not None:
        return TwoLevel(Transport(topology.inner_group, phase, stats, trace) if topology.ranks_per_node > 1 else None,
                        Transport(topology.outer_group, phase, stats, trace) if topology.nodes > 1 else None)
    return Transport(ctx.group, phase, stats, trace)

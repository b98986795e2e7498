"""The ring communicator: paired, batched point-to-point transfers with a strict life cycle.

Life cycle per channel (a named stream of transfers, e.g. ``"kv"`` or ``"dq"``):
``send_recv`` queues "send this to the next rank, receive that from the previous rank",
``commit`` posts everything queued as ONE ``batch_isend_irecv`` (each send paired with its
receive, the same list on every rank: no asymmetric lists, no hang), ``wait`` blocks until
the channel's transfers are done. Misuse (committing twice, waiting on nothing, queueing on
a channel still in flight) raises ``RuntimeError``. Each channel has its own tag so that two
channels in flight between the same pair of ranks never match each other's messages.
No device-wide synchronisation is done: waiting is per transfer.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .trace import StepTrace, now_ns
from .stats import CommStats


class RingCommError(RuntimeError):
    """A ring transfer failed: a peer died, hung past the group's timeout, or the link broke."""


class RingComm:
    """Neighbour ring over ``group``: rank r sends to r+1 and receives from r-1 (mod P).

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
        self.next_global = dist.get_global_rank(group, (self.rank + 1) % self.world_size)
        self.prev_global = dist.get_global_rank(group, (self.rank - 1) % self.world_size)
        self.phase, self.stats, self.trace = phase, stats, trace
        self._queued: dict[str, list[dist.P2POp]] = {}
        self._inflight: dict[str, list] = {}
        self._tags: dict[str, int] = {}

    def _tag(self, channel: str) -> int:
        return self._tags.setdefault(channel, len(self._tags) + 1)

    def open_channels(self, channels: list[str]) -> None:
        """Give ``channels`` their tags in this order. Call it with the same list on every rank
        before the first transfer when ranks may use different channels first (direct schedules)."""
        for c in channels:
            self._tag(c)

    def send_recv(self, channel: str, send: torch.Tensor, recv: torch.Tensor) -> None:
        """Queue ``send -> next rank`` and ``recv <- previous rank`` on ``channel``.

        ``recv`` must not be read or written until :meth:`wait`; ``send`` must not be
        modified until then either.
        """
        if channel in self._inflight:
            raise RuntimeError(f"channel {channel!r} still has transfers in flight; wait() first")
        if send.numel() != recv.numel() or send.dtype != recv.dtype:
            raise RuntimeError(f"channel {channel!r}: send and recv buffers differ "
                               f"({tuple(send.shape)} {send.dtype} vs {tuple(recv.shape)} {recv.dtype})")
        tag = self._tag(channel)
        self._queued.setdefault(channel, []).extend([
            dist.P2POp(dist.isend, send, self.next_global, self.group, tag),
            dist.P2POp(dist.irecv, recv, self.prev_global, self.group, tag),
        ])
        if self.stats is not None:
            nbytes = send.numel() * send.element_size()
            self.stats.record(self.phase, channel, nbytes, nbytes)

    def queue(self, channel: str, kind: str, tensor: torch.Tensor, peer: int, op: str) -> None:
        """Queue one point-to-point transfer with any rank of the group (``kind`` ``"send"`` or
        ``"recv"``; ``peer`` a group rank; ``op`` the meter's label). For the direct schedules
        (DistFlashAttn), where a rank talks to ranks at growing distances: the plan guarantees
        that every queued send has its receive queued on the peer in the same step."""
        if channel in self._inflight:
            raise RuntimeError(f"channel {channel!r} still has transfers in flight; wait() first")
        if kind not in ("send", "recv") or not 0 <= peer < self.world_size or peer == self.rank:
            raise RuntimeError(f"queue: bad transfer {kind!r} with peer {peer} on rank {self.rank}")
        fn = dist.isend if kind == "send" else dist.irecv
        self._queued.setdefault(channel, []).append(
            dist.P2POp(fn, tensor, dist.get_global_rank(self.group, peer), self.group, self._tag(channel)))
        if self.stats is not None:
            nbytes = tensor.numel() * tensor.element_size()
            self.stats.record(self.phase, op, nbytes if kind == "send" else 0, nbytes if kind == "recv" else 0)

    def commit(self, channel: str, step: int = -1, allow_empty: bool = False) -> bool:
        """Post the queued transfers of ``channel`` as one batch; returns whether anything was
        posted (nothing queued raises unless ``allow_empty``)."""
        ops = self._queued.pop(channel, None)
        if not ops:
            if allow_empty:
                return False
            raise RuntimeError(f"commit: nothing queued on channel {channel!r}")
        try:
            self._inflight[channel] = dist.batch_isend_irecv(ops)
        except RuntimeError as e:
            raise self._failure(channel, step, e) from e
        if self.trace is not None:
            self.trace.record("post", self.phase, channel, step, self.rank, now_ns())
        return True

    def wait(self, channel: str, step: int = -1, allow_empty: bool = False) -> None:
        """Block until ``channel``'s transfers are complete (raises on a peer failure/timeout;
        nothing in flight raises unless ``allow_empty``)."""
        works = self._inflight.pop(channel, None)
        if works is None and allow_empty:
            return
        if works is None:
            raise RuntimeError(f"wait: nothing in flight on channel {channel!r}")
        t0 = now_ns()
        try:
            for w in works:
                w.wait()
        except RuntimeError as e:
            raise self._failure(channel, step, e) from e
        if self.trace is not None:
            self.trace.record("wait", self.phase, channel, step, self.rank, t0, now_ns())

    def _failure(self, channel: str, step: int, err: Exception) -> RingCommError:
        return RingCommError(
            f"rank {self.rank}: {self.phase} ring transfer on channel {channel!r} at step {step} "
            f"failed (previous rank {self.prev_global} / next rank {self.next_global} died, hung past "
            f"the process group's timeout, or the link broke): {err}")

    def pending(self) -> bool:
        """Whether anything is queued or in flight."""
        return bool(self._queued or self._inflight)

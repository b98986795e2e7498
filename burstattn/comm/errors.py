"""The communication errors: one base, one class per kind of exchange.

* :class:`RingCommError`: a point-to-point ring transfer failed (a peer died, hung past the group's
  timeout, or the link broke).
* :class:`CollectiveError`: a collective (all-gather, all-reduce, broadcast, the cross-rank check's
  exchange, the recurrences' state summaries) failed the same way.

Both derive from :class:`CommError` (a ``RuntimeError``), so ``except CommError`` catches either.
"""
from __future__ import annotations


class CommError(RuntimeError):
    """A communication step failed: a rank died, hung past the group's timeout, or the link broke."""


class RingCommError(CommError):
    """A point-to-point ring transfer failed."""


class CollectiveError(CommError):
    """A collective exchange (gather, reduce, broadcast, a cross-rank check) failed."""

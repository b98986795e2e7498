"""Communication: the ring communicator and the byte meter."""
from .ring import RingComm, RingCommError
from .stats import CommStats, active_stats, comm_stats

__all__ = ["RingComm", "RingCommError", "CommStats", "active_stats", "comm_stats"]

"""Communication: the ring communicator and the byte meter."""
from .ring import RingComm
from .stats import CommStats, active_stats, comm_stats

__all__ = ["RingComm", "CommStats", "active_stats", "comm_stats"]

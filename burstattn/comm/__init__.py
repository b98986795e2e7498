"""Communication: the loop's transport, metered collectives, the byte meter and the step trace."""
from .stats import CommStats, active_stats, comm_stats
from .transport import RingCommError, Transport

__all__ = ["Transport", "RingCommError", "CommStats", "active_stats", "comm_stats"]

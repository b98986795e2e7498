"""Communication: the loop's transport, metered collectives, the byte meter and the step trace."""
from .stats import CommStats, active_stats, comm_stats
from .errors import CollectiveError, CommError, RingCommError
from .transport import Transport

__all__ = ["Transport", "CommError", "RingCommError", "CollectiveError", "CommStats", "active_stats", "comm_stats"]

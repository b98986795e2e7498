"""How a global sequence is split over ranks: the named layouts (:mod:`.named`: positions, shard and
gather per ``"contiguous"``, ``"zigzag"``, ``"striped"``), explicit partitions (:mod:`.partition`:
:class:`~.partition.Partition`, ``document_partition``) and the cut that balances them
(:mod:`.cut`). Imports only :mod:`burstattn.config` and torch; this package re-exports nothing."""

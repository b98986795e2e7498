"""What the package's own commands measure with (``burstattn demo``, ``burstattn generate``), and what
the repository's ``bench/`` and the tests reuse: the peak-memory meter (:mod:`.memory`), timing and
machine information (:mod:`.timing`) and the progress display of local ranks (:mod:`.progress`).
Imports nothing of the library; this package re-exports nothing."""

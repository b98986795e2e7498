"""Renamed: the engine's adapter (kernel choice, positions and passes) is :mod:`burstattn.passes`.

Importing this module refuses with the new spelling, so outside code that imported it learns where
its names went instead of reading Python's bare "No module named"."""
raise ImportError("burstattn.autograd was renamed burstattn.passes (the engine adapter: kernel choice, "
                  "positions and passes); import from burstattn.passes")

"""The one attention call, built, checked, carried and run:

* :mod:`.call`: :class:`Call`, everything of a call but q, k and v (one frozen dataclass);
* :mod:`.options`: the keywords, written once: ``Keywords`` (every one), ``BurstOptions`` (the rare ones, one
  typed object; the mask's are :class:`burstattn.masks.spec.MaskKeywords`');
* :mod:`.prepare`: :func:`~.prepare.prepare` builds and checks the ``Call`` once per call;
* :mod:`.validate`: the local checks and the cross-rank check of the named signature;
* :mod:`.boundary`: the ``Call`` across the custom op (its spec, the ``repr`` of a tuple, and tensors);
* :mod:`.engine_adapter`: the kernel choice, every rank's positions and the two engine passes.

The registered op pair that runs a prepared call is :mod:`burstattn.ops` (one layer up)."""
from .call import Call
from .options import BurstOptions

__all__ = ["Call", "BurstOptions"]

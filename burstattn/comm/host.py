"""What the call path keeps on the host beside the tensors: the one bounded memo of what calls build
from values that repeat (:class:`LruCache`: process groups, plans, a mask's block summaries, op specs)
and :func:`host_side`, where host-side bookkeeping runs on real tensors inside a dry run."""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Optional


class LruCache:
    """A bounded memo, least recently used entries evicted first: what a call builds from values that
    repeat from call to call (a mask's block summaries, a process group) is built once.

    ``entries``: the cached values by key (oldest first). Sharing one instance process-wide is safe as
    long as every value is a pure function of its key (or, for process groups, made by every rank in
    the same order, which the callers' cross-rank input check guarantees).
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.entries: OrderedDict = OrderedDict()

    def get(self, key, make: Callable[[], object], valid: Optional[Callable[[object], bool]] = None):
        """The value of ``key``: the cached one (unless ``valid(value)`` says it went stale), else
        ``make()``, cached."""
        hit = self.entries.get(key)
        if hit is not None and (valid is None or valid(hit)):
            self.entries.move_to_end(key)
            return hit
        value = make()
        self.entries[key] = value
        self.entries.move_to_end(key)
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)
        return value

    def clear(self) -> None:
        """Forget every entry (the values themselves live on where they are still referenced)."""
        self.entries.clear()



def host_side():
    """A context in which tensor code runs on real tensors even inside a ``FakeTensorMode`` (the dry
    run, :mod:`burstattn.train.dryrun`): for host-side bookkeeping that holds no device memory and is
    read on the host (a mesh's rank lists, the input check's signatures)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()

"""A peer that disappears mid-ring: the surviving ranks must raise, not hang."""
from __future__ import annotations

import pytest

from burstattn.testing.launch import LocalGroupError, run_local
from tests.dist.cases import attention


@pytest.mark.parametrize("world,when", [(2, "before"), (3, "mid")])
def test_vanished_peer_makes_survivors_raise(world, when):
    # a hang would end at the pool's timeout_s with no RuntimeError from the collective on the survivors:
    # the type checks below tell the collective's own timeout (pg_timeout_s) from the pool's
    with pytest.raises(LocalGroupError) as info:
        run_local(attention.vanish, world, when, pg_timeout_s=5.0, timeout_s=120.0)
    errors = info.value.errors
    assert "exited with code 17" in errors[1].message, errors
    for rank in set(range(world)) - {1}:
        assert rank in errors, f"rank {rank} finished although rank 1 vanished: {info.value.results}"
        assert {"RuntimeError", "DistBackendError"} & set(errors[rank].type_names), str(errors[rank])


def test_vanished_peer_is_reported_as_ring_comm_error():
    """Survivors get burstattn's RingCommError (naming the ring and the step), not a raw gloo error,
    whether the failure surfaces when a transfer is posted or when it is waited for."""
    with pytest.raises(LocalGroupError) as info:
        run_local(attention.vanish, 3, "mid", pg_timeout_s=5.0, timeout_s=120.0)
    for rank in (0, 2):
        err = info.value.errors[rank]
        assert "RingCommError" in err.type_names, f"rank {rank} raised {err.type_names[0]}:\n{err.traceback}"

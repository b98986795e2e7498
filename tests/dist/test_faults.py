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


@pytest.mark.parametrize("where", ["all_gather", "recurrence"])
def test_vanished_peer_in_a_collective_is_a_collective_error(where):
    """A collective (or a recurrence's state exchange) that loses a peer raises CollectiveError, a
    CommError like the ring's RingCommError but not one: the error names the kind of exchange."""
    with pytest.raises(LocalGroupError) as info:
        run_local(attention.vanish_before_collective, 3, where, pg_timeout_s=5.0, timeout_s=120.0)
    for rank in (0, 2):
        err = info.value.errors[rank]
        assert "CollectiveError" in err.type_names and "RingCommError" not in err.type_names, \
            f"rank {rank} raised {err.type_names[0]}:\n{err.traceback}"
def test_vanished_peer_before_the_call_is_reported_as_collective_error():
    """A peer gone before the call: the survivors' cross-rank check (burstattn.comm.agree) fails to exchange
    and raises burstattn's CollectiveError, naming the call, not a raw gloo error."""
    with pytest.raises(LocalGroupError) as info:
        run_local(attention.vanish, 2, "before", pg_timeout_s=5.0, timeout_s=120.0)
    err = info.value.errors[0]
    assert "CollectiveError" in err.type_names, f"rank 0 raised {err.type_names[0]}:\n{err.traceback}"
    assert "burst_attn_func: exchanging the cross-rank check failed" in err.message, err.message

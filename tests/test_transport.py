"""The transport layer: header encoding, header checks on arrival, deadlines and aborts."""

import time

import numpy as np
import pytest

from ray_collective.errors import CollectiveMismatchError, GroupBrokenError
from ray_collective.transport.base import COLLECTIVE_TAG
from ray_collective.transport.local import LocalFabric
from ray_collective.transport.wire import CallHeader, CallStamp

HEADER = CallHeader("grp", 3, 17, "allreduce", "ring", "float32", 1000, (10, 100), -1, "SUM")
STAMP = CallStamp.of(HEADER)


def test_header_round_trips_through_its_binary_encoding():
    for header in (HEADER, CallHeader("g", 0, 0, "barrier", "dissemination", "", 0, ()),
                   CallHeader("ünïcode", 2**40, 2**50, "gather", "binomial", "bfloat16", 7, (7,),
                              5, "")):
        assert CallHeader.unpack(header.pack()) == header


@pytest.mark.parametrize("data", [b"", b"\x00" * 5, HEADER.pack()[:-1], HEADER.pack() + b"x"])
def test_malformed_header_is_a_value_error(data):
    with pytest.raises(ValueError, match="malformed"):
        CallHeader.unpack(data)


def _pair():
    fabric = LocalFabric(2, "grp")
    return fabric, fabric.transport(0), fabric.transport(1)


def test_message_arrives_and_is_checked():
    _, a, b = _pair()
    out = np.zeros(4)
    a.isend(1, COLLECTIVE_TAG, STAMP, 2, np.arange(4.0))
    request = b.irecv(0, COLLECTIVE_TAG, STAMP, 2, out)
    assert b.wait([request], time.monotonic() + 1) == ()
    np.testing.assert_array_equal(out, np.arange(4.0))


def test_receive_with_combine_reduces_in_place():
    _, a, b = _pair()
    out = np.ones(3)
    a.isend(1, COLLECTIVE_TAG, STAMP, 0, np.full(3, 2.0))
    def add(acc, incoming):
        np.add(acc, incoming, out=acc)

    b.wait([b.irecv(0, COLLECTIVE_TAG, STAMP, 0, out, add)], time.monotonic() + 1)
    np.testing.assert_array_equal(out, [3.0, 3.0, 3.0])


def test_send_buffer_may_be_reused_once_the_send_completes():
    _, a, b = _pair()
    data, out = np.arange(3.0), np.zeros(3)
    assert a.isend(1, COLLECTIVE_TAG, STAMP, 0, data).done
    data[:] = -1
    b.wait([b.irecv(0, COLLECTIVE_TAG, STAMP, 0, out)], time.monotonic() + 1)
    np.testing.assert_array_equal(out, [0.0, 1.0, 2.0])


@pytest.mark.parametrize("field, value", [("seq", 18), ("collective", "broadcast"),
                                          ("dtype", "float64"), ("count", 999),
                                          ("root", 0), ("op", "MAX"), ("algorithm", "rabenseifner"),
                                          ("epoch", 4)])
def test_arrival_that_differs_raises_mismatch_naming_the_field(field, value):
    _, a, b = _pair()
    theirs = CallStamp.of(CallHeader(**{**HEADER.__dict__, field: value}))
    a.isend(1, COLLECTIVE_TAG, theirs, 0, np.zeros(4))
    request = b.irecv(0, COLLECTIVE_TAG, STAMP, 0, np.zeros(4))
    with pytest.raises(CollectiveMismatchError) as caught:
        b.wait([request], time.monotonic() + 1)
    err = caught.value
    assert err.differences == {field: (getattr(HEADER, field), value)}
    assert err.ranks == (1, 0) and "grp" in str(err) and "#17" in str(err)


def test_step_or_length_mismatch_is_reported():
    _, a, b = _pair()
    a.isend(1, COLLECTIVE_TAG, STAMP, 5, np.zeros(4))
    with pytest.raises(CollectiveMismatchError, match="step"):
        b.wait([b.irecv(0, COLLECTIVE_TAG, STAMP, 6, np.zeros(4))], time.monotonic() + 1)
    a.isend(1, COLLECTIVE_TAG, STAMP, 0, np.zeros(3))
    with pytest.raises(CollectiveMismatchError, match="message elements"):
        b.wait([b.irecv(0, COLLECTIVE_TAG, STAMP, 0, np.zeros(4))], time.monotonic() + 1)


def test_channels_are_separate_and_ordered():
    _, a, b = _pair()
    a.isend(1, 1, STAMP, 0, np.full(1, 1.0))
    a.isend(1, 2, STAMP, 0, np.full(1, 2.0))
    a.isend(1, 1, STAMP, 0, np.full(1, 3.0))
    outs = [np.zeros(1) for _ in range(3)]
    requests = [b.irecv(0, 2, STAMP, 0, outs[0]),
                b.irecv(0, 1, STAMP, 0, outs[1]),
                b.irecv(0, 1, STAMP, 0, outs[2])]
    b.wait(requests, time.monotonic() + 1)
    assert [o[0] for o in outs] == [2.0, 1.0, 3.0]


def test_wait_returns_the_pending_requests_at_the_deadline():
    _, _, b = _pair()
    request = b.irecv(0, COLLECTIVE_TAG, STAMP, 0, np.zeros(1))
    started = time.monotonic()
    assert list(b.wait([request], started + 0.1)) == [request]
    assert 0.09 <= time.monotonic() - started < 2


def test_abort_wakes_every_waiting_rank_with_the_cause():
    fabric, a, b = _pair()
    cause = RuntimeError("rank 0 failed")
    a.abort(cause)
    with pytest.raises(GroupBrokenError) as caught:
        b.wait([b.irecv(0, COLLECTIVE_TAG, STAMP, 0, np.zeros(1))], time.monotonic() + 5)
    assert caught.value.cause is cause


def test_absent_ranks_are_those_that_did_not_start_the_call():
    fabric = LocalFabric(3, "grp")
    transports = [fabric.transport(r) for r in range(3)]
    transports[0].arrive(STAMP)
    transports[2].arrive(STAMP)
    assert transports[0].absent_ranks(HEADER.seq) == [1]


def test_fabric_rejects_ranks_out_of_range():
    with pytest.raises(ValueError, match="rank 2"):
        LocalFabric(2).transport(2)

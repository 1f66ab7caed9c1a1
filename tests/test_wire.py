"""The wire protocol without I/O: header stamps, frames, and the matching of parts to receives."""

import numpy as np
import pytest

from ray_collective.errors import CollectiveMismatchError
from ray_collective.transport import wire
from ray_collective.transport.wire import CallHeader, CallStamp, HeaderTemplate, Inbox, Receive

HEADER = CallHeader("grp", 3, 0, "allreduce", "ring", "float32", 6, (2, 3), -1, "SUM")


def _add(acc, incoming):
    np.add(acc, incoming, out=acc)


class Sender:
    """Builds the packets a peer would send (what a driver reads from its socket)."""

    def __init__(self, stamp, step=0, tag=wire.COLLECTIVE_TAG):
        self.stamp, self.step, self.tag = stamp, step, tag

    def inline(self, payload: np.ndarray, count=None, offset=0, total=None):
        raw = payload.tobytes()
        total = len(raw) if total is None else total
        count = len(payload) if count is None else count
        frame = wire.data_frame(self.step, self.tag, count, total, offset, len(raw), wire.INLINE,
                                0, len(self.stamp.packed))
        return bytearray(frame + self.stamp.packed + raw)

    def shared(self, count, total, offset, nbytes, segment, segment_offset):
        frame = wire.data_frame(self.step, self.tag, count, total, offset, nbytes, segment,
                                segment_offset, len(self.stamp.packed))
        return bytearray(frame + self.stamp.packed)


class Memory:
    """Stands in for the senders' shared memory: segment -> bytes; records every release."""

    def __init__(self):
        self.segments = {}
        self.released = []

    def read(self, part):
        data = self.segments[part.segment]
        return np.frombuffer(data, np.uint8)[part.segment_offset:
                                             part.segment_offset + part.part_bytes]

    def consumed(self, part):
        self.released.append((part.segment, part.segment_offset))


def _inbox(memory=None):
    memory = memory or Memory()
    return Inbox(1, memory.read, memory.consumed), memory


def _arrive(inbox, packet, key=(0, wire.COLLECTIVE_TAG)):
    """Parse ``packet`` as a driver does (views into its buffer) and hand it over."""
    tag, part = wire.parse_data(memoryview(packet), "link")
    assert (0, tag) == key
    return inbox.arrive(key, part)


def test_stamps_pack_the_sequence_number_in_place():
    template = HeaderTemplate(HEADER)
    for seq in (0, 1, 17, 2**40):
        stamp = template.stamp(seq)
        assert stamp.packed == CallHeader(**{**HEADER.__dict__, "seq": seq}).pack()
        assert stamp.header.seq == seq and stamp.seq == seq
        assert CallHeader.unpack(stamp.packed) == stamp.header


def test_inline_message_is_consumed_as_it_arrives_when_its_receive_is_posted():
    stamp = HeaderTemplate(HEADER).stamp(4)
    inbox, _ = _inbox()
    out = np.zeros(6, np.float32)
    receive = Receive(0, stamp, 2, out, None)
    inbox.post((0, wire.COLLECTIVE_TAG), receive)
    packet = Sender(stamp, step=2).inline(np.arange(6, dtype=np.float32))
    assert _arrive(inbox, packet) is True
    packet[:] = b"\xff" * len(packet)  # the driver reuses its buffer for the next packet
    assert receive.done and inbox.error is None
    np.testing.assert_array_equal(out, np.arange(6))


def test_early_parts_are_kept_whole_until_their_receive_is_posted():
    stamp = HeaderTemplate(HEADER).stamp(0)
    memory = Memory()
    memory.segments[7] = np.arange(100, 106, dtype=np.float32).tobytes()
    inbox, _ = _inbox(memory)
    sender = Sender(stamp)
    first = sender.inline(np.arange(3, dtype=np.float32), count=6, total=24)
    assert _arrive(inbox, first) is False
    first[:] = b"\x00" * len(first)  # overwritten by the next packet: the kept part owns a copy
    second = sender.shared(6, 24, 12, 12, segment=7, segment_offset=12)
    assert _arrive(inbox, second) is False
    second[:] = b"\x00" * len(second)
    assert inbox.unexpected_parts() == 2
    out = np.ones(6, np.float32)
    receive = Receive(0, stamp, 0, out, _add)
    inbox.post((0, wire.COLLECTIVE_TAG), receive)
    assert receive.done and inbox.error is None
    np.testing.assert_array_equal(out, [1, 2, 3, 104, 105, 106])
    assert memory.released == [(7, 12)] and inbox.unexpected_parts() == 0


def test_a_message_in_parts_completes_with_its_last_part():
    stamp = HeaderTemplate(HEADER).stamp(0)
    memory = Memory()
    memory.segments[0] = np.arange(6, dtype=np.float32).tobytes()
    inbox, _ = _inbox(memory)
    out = np.zeros(6, np.float32)
    receive = Receive(0, stamp, 0, out, None)
    inbox.post((0, wire.COLLECTIVE_TAG), receive)
    sender = Sender(stamp)
    for offset in (0, 8, 16):
        assert not receive.done
        assert _arrive(inbox, sender.shared(6, 24, offset, 8, 0, offset))
    assert receive.done
    np.testing.assert_array_equal(out, np.arange(6))
    assert memory.released == [(0, 0), (0, 8), (0, 16)]


def test_messages_of_one_channel_match_receives_in_posting_order():
    stamp = CallStamp.of(CallHeader("g", 0, 0, "send/recv", "direct", "int64", 1, (1,)))
    inbox, _ = _inbox()
    outs = [np.zeros(1, np.int64) for _ in range(3)]
    receives = [Receive(0, stamp, 0, out, None) for out in outs]
    _arrive(inbox, Sender(stamp, tag=1).inline(np.array([10])), key=(0, 1))
    _arrive(inbox, Sender(stamp, tag=2).inline(np.array([20])), key=(0, 2))
    _arrive(inbox, Sender(stamp, tag=1).inline(np.array([11])), key=(0, 1))
    inbox.post((0, 2), receives[0])
    inbox.post((0, 1), receives[1])
    inbox.post((0, 1), receives[2])
    assert [int(o[0]) for o in outs] == [20, 10, 11]


def test_zero_length_message_completes():
    stamp = CallStamp.of(CallHeader("g", 0, 0, "barrier", "dissemination", "", 0, ()))
    inbox, _ = _inbox()
    receive = Receive(0, stamp, 3, np.zeros(0, np.uint8), None)
    inbox.post((0, wire.COLLECTIVE_TAG), receive)
    _arrive(inbox, Sender(stamp, step=3).inline(np.zeros(0, np.uint8)))
    assert receive.done and inbox.error is None


@pytest.mark.parametrize("field, value", [("seq", 5), ("dtype", "int32"), ("root", 2),
                                          ("algorithm", "recursive_doubling"), ("op", "MAX")])
def test_a_part_of_another_call_is_a_mismatch_naming_what_differs(field, value):
    mine = HeaderTemplate(HEADER).stamp(4)
    theirs = CallStamp.of(CallHeader(**{**HEADER.__dict__, "seq": 4, field: value}))
    inbox, _ = _inbox()
    out = np.zeros(6, np.float32)
    receive = Receive(0, mine, 0, out, None)
    inbox.post((0, wire.COLLECTIVE_TAG), receive)
    _arrive(inbox, Sender(theirs).inline(np.ones(6, np.float32)))
    assert not receive.done
    assert isinstance(inbox.error, CollectiveMismatchError)
    assert inbox.error.differences == {field: (getattr(mine.header, field), value)}
    assert inbox.error.ranks == (1, 0)
    np.testing.assert_array_equal(out, 0)  # nothing of a mismatched message is written


@pytest.mark.parametrize("arrives_first", [True, False])
def test_a_part_of_the_same_call_with_another_header_is_a_mismatch_without_any_receive(
        arrives_first):
    """Ranks that disagree on the root disagree on who sends to whom: the part is checked
    against the call this rank is in, whether it came before the call began or after."""
    mine = HeaderTemplate(HEADER).stamp(4)
    theirs = CallStamp.of(CallHeader(**{**HEADER.__dict__, "seq": 4, "root": 2}))
    inbox, _ = _inbox()
    if not arrives_first:
        inbox.begin(mine)
    _arrive(inbox, Sender(theirs).inline(np.ones(6, np.float32)))
    if arrives_first:
        assert inbox.error is None  # no call begun yet: nothing to compare with
        inbox.begin(mine)
    assert isinstance(inbox.error, CollectiveMismatchError)
    assert inbox.error.differences == {"root": (-1, 2)} and inbox.error.ranks == (1, 0)


def test_parts_of_other_calls_and_other_channels_wait_for_their_receives():
    """A fast peer's next call, and a send/recv of the same number, are not mismatches."""
    mine = HeaderTemplate(HEADER).stamp(4)
    inbox, _ = _inbox()
    inbox.begin(mine)
    _arrive(inbox, Sender(HeaderTemplate(HEADER).stamp(5)).inline(np.ones(6, np.float32)))
    p2p = CallStamp.of(CallHeader("grp", 3, 4, "send/recv", "direct", "float32", 6, (6,)))
    _arrive(inbox, Sender(p2p, tag=3).inline(np.ones(6, np.float32)), key=(0, 3))
    _arrive(inbox, Sender(mine).inline(np.ones(6, np.float32)))
    assert inbox.error is None and inbox.unexpected_parts() == 3


def test_step_count_and_part_order_are_checked():
    stamp = HeaderTemplate(HEADER).stamp(0)
    for packet, expected in [
            (Sender(stamp, step=1).inline(np.ones(6, np.float32)), "step"),
            (Sender(stamp).inline(np.ones(5, np.float32)), "message elements"),
            (Sender(stamp).inline(np.ones(3, np.float32), count=6, offset=12, total=24),
             "message part")]:
        inbox, _ = _inbox()
        inbox.post((0, wire.COLLECTIVE_TAG), Receive(0, stamp, 0, np.zeros(6, np.float32), None))
        _arrive(inbox, packet)
        assert expected in str(inbox.error)


def test_a_shared_part_that_cannot_be_read_whole_is_an_error_and_still_released():
    stamp = HeaderTemplate(HEADER).stamp(0)
    memory = Memory()
    memory.segments[0] = b"\x00" * 8  # shorter than the part claims
    inbox, _ = _inbox(memory)
    inbox.post((0, wire.COLLECTIVE_TAG), Receive(0, stamp, 0, np.zeros(6, np.float32), None))
    _arrive(inbox, Sender(stamp).shared(6, 24, 0, 24, 0, 0))
    assert "part bytes readable" in str(inbox.error)
    assert memory.released == [(0, 0)]


@pytest.mark.parametrize("corrupt", [
    lambda p: p[:wire.DATA_FRAME.size - 1],                      # frame cut short
    lambda p: p[:wire.DATA_FRAME.size + 3],                      # header cut short
    lambda p: p + b"extra",                                      # inline payload too long
])
def test_malformed_data_frames_are_value_errors(corrupt):
    stamp = HeaderTemplate(HEADER).stamp(0)
    packet = corrupt(bytes(Sender(stamp).inline(np.ones(6, np.float32))))
    with pytest.raises(ValueError):
        wire.parse_data(memoryview(packet), None)


def test_hello_carries_the_rank_and_key_and_nothing_else():
    assert wire.parse_hello(wire.hello(5, b"k" * 16)) == (5, b"k" * 16)
    with pytest.raises(ValueError):
        wire.parse_hello(wire.hello(5, b"k" * 16) + b"x")
    with pytest.raises(ValueError):
        wire.parse_hello(wire.release_frame(0, 0))


def _head(packet, nbytes):
    """The start of ``packet`` up to its call header (what a stream driver has read first)."""
    return wire.parse_data_head(memoryview(bytes(packet[:len(packet) - nbytes])), "link")


def test_a_payload_is_placed_only_where_a_copying_receive_waits_for_exactly_it():
    stamp = HeaderTemplate(HEADER).stamp(0)
    key = (0, wire.COLLECTIVE_TAG)
    sender = Sender(stamp, step=1)
    data = np.arange(6, dtype=np.float32)
    second_half = sender.inline(data[3:], count=6, offset=12, total=24)
    inbox, _ = _inbox()
    assert inbox.destination(key, _head(second_half, 12)[1]) is None     # nothing posted
    out = np.zeros(6, np.float32)
    receive = Receive(0, stamp, 1, out, None)
    inbox.post(key, receive)
    # the receive expects offset 0 first: the second half would be a mismatch
    assert inbox.destination(key, _head(second_half, 12)[1]) is None
    first_half = sender.inline(data[:3], count=6, total=24)
    target = inbox.destination(key, _head(first_half, 12)[1])
    assert len(target) == 12
    target[:] = data[:3].tobytes()            # the driver reads the payload straight there
    tag, part = wire.parse_data(memoryview(bytes(first_half[:-12])), "link", target)
    assert part.placed and inbox.arrive(key, part) is True
    assert receive.received == 12 and not receive.done
    assert _arrive(inbox, second_half) is True
    assert receive.done and inbox.error is None
    np.testing.assert_array_equal(out, data)
    # a receive that reduces, or one behind a part that came early, takes no placement
    reducing = Receive(0, stamp, 1, np.zeros(6, np.float32), _add)
    inbox.post(key, reducing)
    whole = sender.inline(data)
    assert inbox.destination(key, _head(whole, 24)[1]) is None
    assert _arrive(inbox, whole) is True and reducing.done
    early = HeaderTemplate(HEADER).stamp(1)
    assert _arrive(inbox, Sender(early, step=1).inline(data)) is False
    inbox.post(key, Receive(0, early, 1, np.zeros(6, np.float32), None))
    assert inbox.destination(key, _head(Sender(early, step=1).inline(data), 24)[1]) is None


def test_a_placed_part_that_must_wait_owns_a_copy_of_its_bytes():
    stamp = HeaderTemplate(HEADER).stamp(0)
    packet = Sender(stamp).inline(np.arange(6, dtype=np.float32))
    placed = bytearray(np.arange(6, dtype=np.float32).tobytes())
    tag, part = wire.parse_data(memoryview(bytes(packet[:-24])), "link", memoryview(placed))
    part.keep()
    placed[:] = b"\x00" * 24
    assert not part.placed and part.payload == np.arange(6, dtype=np.float32).tobytes()

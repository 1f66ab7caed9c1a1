"""One native Node's behaviour around a call: mismatches, slices and wake-ups, dead peers,
buffered sends, channels, the memory a ring touches, and hostile files and arguments.

Ranks are Nodes in threads of this process (progress releases the GIL), or a spawned process
where a rank must die. Ordering between ranks goes through events and the calls themselves,
never through sleeps; the only time bounds are generous ceilings that a hang would break.
"""

import contextlib
import multiprocessing
import os
import threading
import time

import numpy as np
import pytest

from ray_collective import native
from ray_collective.algorithms.catalog import ALGORITHMS
from ray_collective.algorithms.core import Blocks, Team
from ray_collective.engine.plan import (Local, Message, Place, Plan, StridedPlace, point_to_point,
                                        record)
from ray_collective.transport import wire
from ray_collective.transport.node_state import CODE_SPAN, COLLECTIVE_CODES, NodeState
from ray_collective.transport.wire import CallHeader, HeaderTemplate
from ray_collective.types import ReduceOp

pytestmark = pytest.mark.skipif(not native.available(),
                                reason=f"native core not built: {native.import_error()}")

if native.available():
    from ray_collective.native import _core
    from ray_collective.native.codes import NO_OP, dtype_code, encode_plan, op_code
    from support.native_processes import Call, node_directory, start

HANG = 30.0
"""Seconds after which a test that waits for something declares it hung."""


def node(directory, rank, world=2, ring_bytes=1 << 16, part_bytes=4096, spin_ns=0,
         remote_min_bytes=0):
    return _core.Node(directory, rank, world, ring_bytes, part_bytes, spin_ns, remote_min_bytes)


def stamp(collective="allreduce", algorithm="recursive_doubling", count=4, seq=0, root=-1,
          op="SUM", dtype="float64"):
    header = CallHeader("g", 0, 0, collective, algorithm, dtype, count, (count,), root, op)
    return HeaderTemplate(header).stamp(seq)


def allreduce(rank, p=2, count=4, seq=0, op=ReduceOp.SUM, value=None):
    """Rank ``rank``'s call of a float64 allreduce by recursive doubling."""
    plan = record(ALGORITHMS["allreduce"]["recursive_doubling"], Team.world(p, rank),
                  np.float64, count)
    data = np.full(count, rank + 1.0 if value is None else value)
    return Call(encode_plan(plan), plan.slots(data), stamp(count=count, seq=seq, op=op.name)
                .packed, dtype_code("float64"), op_code(op, "float64"))


def finish(node_, call_=None, slice_s=0.05):
    """Start ``call_`` (unless None) and progress it until it is not PENDING."""
    if call_ is not None:
        start(node_, call_)
    deadline = time.monotonic() + HANG
    status = node_.progress(slice_s)
    while status == _core.PENDING:
        assert time.monotonic() < deadline, "the call hung"
        status = node_.progress(slice_s)
    return status


def in_thread(function, *args):
    """Run ``function`` in a thread; returns a getter of its result (or its exception)."""
    result = {}

    def main():
        try:
            result["value"] = function(*args)
        except BaseException as err:  # handed to the test
            result["error"] = err

    thread = threading.Thread(target=main, daemon=True)
    thread.start()

    def get():
        thread.join(HANG)
        assert not thread.is_alive(), "the thread hung"
        if "error" in result:
            raise result["error"]
        return result["value"]
    return get


def both(directory, calls, **node_args):
    """Run one call on each of two Nodes at once; their statuses, slots and details."""
    def rank_main(rank):
        with node(directory, rank, **node_args) as n:
            status = finish(n, calls[rank])
            return status, calls[rank].slots, n.mismatch_details()
    other = in_thread(rank_main, 1)
    return [rank_main(0), other()]


# ------------------------------------------------------------------------------ calls

def test_two_ranks_allreduce_and_consecutive_calls_reuse_the_rings():
    with node_directory() as directory:
        for seq in range(3):
            results = both(directory, [allreduce(0, seq=seq), allreduce(1, seq=seq)])
            for status, slots, details in results:
                assert status == _core.DONE and details is None
                np.testing.assert_array_equal(slots[0], np.full(4, 3.0))


def test_world_size_one_and_an_empty_plan_are_done_at_once():
    with node_directory() as directory, node(directory, 0, world=1) as alone:
        empty = Plan(None, [], [], np.dtype(np.float32))
        alone.start(_core.Program(encode_plan(empty), dtype_code("float32"), NO_OP),
                    empty.slots(None), b"")
        assert alone.active and alone.progress(0) == _core.DONE and not alone.active
        call = allreduce(0, p=1)
        assert finish(alone, call) == _core.DONE
        np.testing.assert_array_equal(call.slots[0], np.ones(4))


def run_call(node_, call_, seq, slice_s=0.05, call_code=5):
    """``Node.run`` of ``call_`` as call number ``seq`` (its header's number is replaced)."""
    return node_.run(call_.program(), call_.slots, call_.header, seq, call_.tag,
                     call_code=call_code, slice_s=slice_s)


def test_run_writes_the_call_number_into_the_header_and_records_on_the_state_page():
    """Two ranks run the same header template as calls 7 and 8: rank 0's run is a mismatch
    whose frame carries 8. With the state page bound, a run that is DONE leaves the rank's
    started word at seq + 1, its beat at 0 and its call word at start (ms) x span + code; a
    run left PENDING (its peer absent) leaves its beat at the start."""
    with node_directory() as directory:
        template = allreduce(0, seq=0)
        other = allreduce(1, seq=0)

        def rank1():
            with node(directory, 1) as n:
                status = run_call(n, other, 8, slice_s=HANG)
                return status
        late = in_thread(rank1)
        with node(directory, 0) as n:
            status = run_call(n, template, 7, slice_s=HANG)
            assert status == _core.MISMATCH
            got = CallHeader.unpack(n.mismatch_details()["header"])
            assert got.seq == 8
        assert late() == _core.MISMATCH

    with node_directory() as directory:
        page = bytearray(8 * 10)
        words = memoryview(page).cast("q")
        nodes = [node(directory, rank) for rank in range(2)]
        try:
            for rank, n in enumerate(nodes):
                n.bind_state(page, 1 + rank, 3 + rank, 5 + rank, 64)
            before = int(time.monotonic() * 1000)
            assert run_call(nodes[0], allreduce(0), 3, slice_s=0.01, call_code=5) \
                == _core.PENDING
            assert words[1] == 4 and words[3] >= before and words[5] // 64 == words[3]
            assert words[5] % 64 == 5 and words[2] == words[4] == 0
            second = in_thread(run_call, nodes[1], allreduce(1), 3, HANG, 9)
            assert finish(nodes[0]) == _core.DONE
            assert second() == _core.DONE
            assert words[2] == 4 and words[4] == 0 and words[6] % 64 == 9
            # progress() leaves the beat to the caller (NodeState.complete), run() clears it
            # only when the call is over at its return.
            assert words[3] >= before
            # A send or recv (a tag >= 0: numbered per channel) records nothing, waiting or
            # not: the page's words stay those of the last collective.
            kept = words.tolist()
            data = np.arange(4.0)
            assert run_call(nodes[1], moved(False, 0, np.empty(4), tag=2), 12, 0.01) \
                == _core.PENDING
            assert run_call(nodes[0], moved(True, 1, data, tag=2), 12) == _core.DONE
            assert finish(nodes[1]) == _core.DONE
            assert words.tolist() == kept
        finally:
            for n in nodes:
                n.close()
        words.release()
        page.extend(b"closed")  # BufferError while a closed node still held the page


def words_on(state, rank):
    """``rank``'s started, beat and call words on ``state``'s page, where ``words_of`` says."""
    where = state.words_of(rank)
    return np.frombuffer(where.page, np.int64)[[where.started, where.beat, where.call]].tolist()


def test_the_core_records_on_a_node_state_page_what_arrive_and_complete_write(tmp_path):
    """Two Nodes bound to a group's NodeState page (``words_of``) run allreduces as calls 3 and
    4, each named as another collective. Each rank's words equal those ``NodeState.arrive`` (and,
    once ``run`` returned DONE, ``complete``) write on a second page for the same rank, call and
    collective: the started word, the beat, the call word's code; a start lies within the
    window of the call, and a waiting rank's beat is its call's start."""
    with node_directory() as directory:
        bound, reference = NodeState(directory, "g", 2), NodeState(str(tmp_path), "g", 2)
        nodes = [node(directory, rank) for rank in range(2)]
        try:
            for rank, n in enumerate(nodes):
                n.bind_state(*bound.words_of(rank))
            for seq, collective in [(3, "reduce"), (4, "allgather")]:
                code = COLLECTIVE_CODES[collective]
                before = int(time.monotonic() * 1000)
                assert run_call(nodes[0], allreduce(0, seq=seq), seq, 0.01, code) == _core.PENDING
                reference.arrive(0, seq, collective)
                waiting, expected = words_on(bound, 0), words_on(reference, 0)
                late = in_thread(run_call, nodes[1], allreduce(1, seq=seq), seq, HANG, code)
                assert finish(nodes[0]) == _core.DONE and late() == _core.DONE
                reference.arrive(1, seq, collective)
                reference.complete(1)
                after = int(time.monotonic() * 1000)
                for words in (waiting, expected):  # in the call
                    assert words[0] == seq + 1 and words[2] % CODE_SPAN == code
                    assert before <= words[1] == words[2] // CODE_SPAN <= after
                for words in (words_on(bound, 1), words_on(reference, 1)):  # out of it
                    assert words[:2] == [seq + 1, 0] and words[2] % CODE_SPAN == code
                    assert before <= words[2] // CODE_SPAN <= after
        finally:
            for n in nodes:
                n.close()
            bound.close()
            reference.close()


def test_run_and_bind_state_refuse_bad_arguments():
    with node_directory() as directory, node(directory, 0) as n:
        call = allreduce(0)
        program = call.program()
        with pytest.raises(TypeError, match="missing required argument 'tag'"):
            n.run(program, call.slots, call.header, 0)
        with pytest.raises(TypeError, match="at most 7 arguments"):
            n.run(program, call.slots, call.header, 0, -1, 1, 0.0, 0)
        with pytest.raises(TypeError, match="unexpected keyword argument 'code'"):
            n.run(program, call.slots, call.header, 0, -1, 1, 0.0, code=0)
        with pytest.raises(TypeError, match="multiple values for argument 'seq'"):
            n.run(program, call.slots, call.header, 0, -1, 1, 0.0, seq=0)
        with pytest.raises(TypeError, match="must be a Program"):
            n.run(call.code, call.slots, call.header, 0, -1, 1, 0.0)
        with pytest.raises(ValueError, match="at least 0"):
            run_call(n, call, -1)
        with pytest.raises(ValueError, match="at least 0"):
            run_call(n, call, 0, slice_s=-1.0)
        with pytest.raises(ValueError, match="too short"):
            n.run(program, call.slots, b"short", 0, -1, 1, 0.0)
        assert not n.active
        page = bytearray(8 * 4)
        for words in [(4, 0, 0), (0, -1, 0), (0, 0, 9)]:
            with pytest.raises(ValueError, match="inside"):
                n.bind_state(page, *words, 64)
        with pytest.raises(ValueError, match="code_span"):
            n.bind_state(page, 0, 1, 2, 0)
        with pytest.raises(BufferError):
            n.bind_state(bytes(32), 0, 1, 2, 64)


def test_local_steps_copy_and_combine_strided_and_overlapping_places():
    """A reversed 2-D copy between slots, a strided combine, and a copy onto an overlapping
    part of its own slot (numpy reads the source as it was; so must we)."""
    slot0 = np.arange(12, dtype=np.int32)
    plan = Plan(None, [
        Local("copy", StridedPlace(2, 8, (3, 4), (-4, 1)), StridedPlace(0, 0, (3, 4), (4, 1))),
        Local("combine", StridedPlace(0, 0, (6,), (2,)), StridedPlace(2, 1, (6,), (2,))),
        Local("copy", Place(0, 2, 12), Place(0, 0, 10)),
    ], [12], np.dtype(np.int32))
    slots = plan.slots(slot0.copy())
    expected = [a.copy() for a in slots]
    for step in plan.steps:
        step.run(expected, lambda acc, incoming: np.add(acc, incoming, out=acc))
    with node_directory() as directory, node(directory, 0, world=1) as alone:
        alone.start(_core.Program(encode_plan(plan), dtype_code("int32"),
                                  op_code(ReduceOp.SUM, "int32")), slots, b"")
        assert alone.progress(0) == _core.DONE
    for ours, theirs in zip(slots, expected):
        np.testing.assert_array_equal(ours, theirs)


def test_point_to_point_channels_do_not_block_a_collective_between_them():
    """Rank 0 sends on tag 5, then both allreduce, then rank 1 receives tag 5: the collective
    finds the tag-5 message first in its ring and sets it aside for the receive."""
    count = 1000
    message = np.arange(count, dtype=np.float64)
    with node_directory() as directory:
        def rank_main(rank):
            with node(directory, rank, part_bytes=512) as n:
                p2p = point_to_point(rank == 0, 1 - rank, count, np.float64)
                slots = p2p.slots(message.copy() if rank == 0 else np.zeros(count))
                call = Call(encode_plan(p2p), slots, stamp("send/recv", "direct", count).packed,
                            dtype_code("float64"), NO_OP, 5)
                if rank == 0:
                    assert finish(n, call) == _core.DONE
                collective = allreduce(rank)
                assert finish(n, collective) == _core.DONE
                if rank == 1:
                    assert finish(n, call) == _core.DONE
                return collective.slots[0], slots[0]
        other = in_thread(rank_main, 1)
        mine, theirs = rank_main(0), other()
    np.testing.assert_array_equal(mine[0], np.full(4, 3.0))
    np.testing.assert_array_equal(theirs[0], np.full(4, 3.0))
    np.testing.assert_array_equal(theirs[1], message)


def test_a_call_that_sent_into_overflow_is_done_only_once_the_peer_took_it():
    """Over a 1 KiB ring, rank 0's 80 kB message of a collective cannot all be framed: the
    call stays PENDING until rank 1 has drained it, then both are DONE."""
    count = 10_000
    data = np.arange(count, dtype=np.float64)
    with node_directory() as directory:
        sender, receiver = (node(directory, rank, ring_bytes=1024, part_bytes=16)
                            for rank in range(2))
        with sender, receiver:
            start(sender, moved(True, 1, data.copy()))
            for _ in range(3):
                assert sender.progress(0.02) == _core.PENDING
            out = np.zeros(count)
            start(receiver, moved(False, 0, out))
            got = in_thread(finish, receiver)
            assert finish(sender) == _core.DONE
            assert got() == _core.DONE
    np.testing.assert_array_equal(out, data)


# ------------------------------------------------------------------ reading in place

REMOTE_COUNT = 50_000
"""float64 elements of the large message the tests below offer to be read in place."""


def moved(is_send, peer, data, tag=-1):
    """A call that sends ``data`` to ``peer`` (or receives into it) on channel ``tag``; with
    tag -1 a collective that reduces nothing, whose large messages are offered."""
    plan = point_to_point(is_send, peer, len(data), np.float64)
    return Call(encode_plan(plan), plan.slots(data), stamp("broadcast", "binomial", len(data),
                                                           root=0, op="").packed,
                dtype_code("float64"), NO_OP, tag)


def remote_nodes(directory, **node_args):
    return [node(directory, rank, remote_min_bytes=1024, **node_args) for rank in range(2)]


@contextlib.contextmanager
def offering(data):
    """Two nodes that read large messages in place, with rank 0's send of ``data`` to rank 1
    started."""
    with node_directory() as directory:
        sender, receiver = remote_nodes(directory)
        with sender, receiver:
            start(sender, moved(True, 1, data))
            yield sender, receiver


def test_a_large_message_is_read_in_place_and_its_sender_done_once_read():
    data = np.arange(REMOTE_COUNT, dtype=np.float64)
    out = np.zeros(REMOTE_COUNT)
    with offering(data) as (sender, receiver):
        assert sender.remote_min_bytes == 1024
        # Offered: the sender waits for its reader, however long its ring is idle.
        assert sender.progress(0.005) == _core.PENDING
        got = in_thread(finish, receiver, moved(False, 0, out))
        assert finish(sender) == _core.DONE
        assert got() == _core.DONE
        assert receiver.remote_reads == 1 and sender.remote_reads == 0
    np.testing.assert_array_equal(out, data)


def test_a_large_message_is_reduced_in_place_a_piece_at_a_time():
    """A receive that reduces reads the offered message in pieces of 64 KiB (7 here, the
    last one short) and adds each into its place: numpy's sums, one read."""
    data = np.arange(REMOTE_COUNT, dtype=np.float64)
    out = np.full(REMOTE_COUNT, 0.5)
    header = stamp("reduce", "binomial", REMOTE_COUNT, root=1).packed
    receive = Plan(None, [(Message(False, 0, 0, Place(0, 0, REMOTE_COUNT), True),)], [],
                   np.dtype(np.float64))
    send = point_to_point(True, 1, REMOTE_COUNT, np.float64)
    codes = (dtype_code("float64"), op_code(ReduceOp.SUM, "float64"))
    with node_directory() as directory:
        sender, receiver = remote_nodes(directory)
        with sender, receiver:
            got = in_thread(finish, receiver, Call(encode_plan(receive), receive.slots(out),
                                                   header, *codes))
            assert finish(sender, Call(encode_plan(send), send.slots(data), header,
                                       *codes)) == _core.DONE
            assert got() == _core.DONE
            assert receiver.remote_reads == 1
    np.testing.assert_array_equal(out, data + 0.5)


def test_an_offer_in_the_last_round_waits_for_its_reader_however_late():
    """The call's last round with messages: taking the offer back would free nothing the call
    waits for, so after stalls far past the offer's grace (20 ms) the receiver still reads it
    in place, from the caller's memory rather than a copy (what the caller writes there
    meanwhile, which no user should, is what the receiver gets)."""
    data = np.arange(REMOTE_COUNT, dtype=np.float64)
    out = np.zeros(REMOTE_COUNT)
    with offering(data) as (sender, receiver):
        for _ in range(3):
            assert sender.progress(0.05) == _core.PENDING
        data += 1.0
        got = in_thread(finish, receiver, moved(False, 0, out))
        assert finish(sender) == _core.DONE
        assert got() == _core.DONE
        assert receiver.remote_reads == 1
    np.testing.assert_array_equal(out, np.arange(REMOTE_COUNT, dtype=np.float64) + 1.0)


def large_then_small(is_send, peer, data):
    """A collective's two rounds with ``peer``: all of ``data`` (offered when sent), then its
    first element again (slot 2, scratch): the large message is not in the last round."""
    steps = [(Message(is_send, peer, 0, Place(0, 0, len(data)), False),),
             (Message(is_send, peer, 1, Place(2, 0, 1), False),)]
    plan = Plan(None, steps, [1], np.dtype(np.float64))
    slots = plan.slots(data)
    if is_send:
        slots[2][0] = data[0]
    return Call(encode_plan(plan), slots, stamp("broadcast", "custom", len(data), root=0,
                                                op="").packed, dtype_code("float64"), NO_OP, -1)


def test_an_offer_nobody_reads_is_taken_back_and_its_copy_read_in_place():
    """The receiver comes only after the sender's stall outlasted the offer's grace, in a
    round before the call's last: the sender takes its offer back, so its round ends and its
    caller's memory is free, and offers its copy instead, which the receiver reads in place."""
    data = np.arange(REMOTE_COUNT, dtype=np.float64)
    out = np.zeros(REMOTE_COUNT)
    with node_directory() as directory:
        sender, receiver = remote_nodes(directory)
        with sender, receiver:
            start(sender, large_then_small(True, 1, data))
            for _ in range(3):
                assert sender.progress(0.05) == _core.PENDING
            data[:] = -1.0  # the caller's memory is no longer read once taken back
            receive = large_then_small(False, 0, out)
            got = in_thread(finish, receiver, receive)
            assert finish(sender) == _core.DONE
            assert got() == _core.DONE
            assert receiver.remote_reads == 1
            assert receive.slots[2][0] == 0.0
    np.testing.assert_array_equal(out, np.arange(REMOTE_COUNT, dtype=np.float64))


def test_a_large_send_whose_receiver_waits_is_read_in_place():
    """A point-to-point message past the node's p2p_max_bytes (a quarter of a 64 KiB ring)
    is offered: a receiver that already waits reads it from the sender's memory."""
    data = np.arange(REMOTE_COUNT, dtype=np.float64)
    out = np.zeros(REMOTE_COUNT)
    with node_directory() as directory:
        sender, receiver = remote_nodes(directory)
        with sender, receiver:
            assert sender.p2p_max_bytes == 16 << 10
            start(receiver, moved(False, 0, out, tag=3))
            assert receiver.progress(0.005) == _core.PENDING
            got = in_thread(finish, receiver)
            assert finish(sender, moved(True, 1, data, tag=3)) == _core.DONE
            assert got() == _core.DONE
            assert receiver.remote_reads == 1
    np.testing.assert_array_equal(out, data)


def test_a_large_send_nobody_reads_is_rerouted_on_both_sides():
    """No receiver within the send's grace (1 ms): the sender takes its offer back and ends
    REROUTED (its caller then sends over the transport, whose sends never wait); its memory
    is no longer read. The receiver that comes later finds the offer taken back, reads
    nothing, and ends REROUTED too (its caller receives over the transport)."""
    data = np.arange(REMOTE_COUNT, dtype=np.float64)
    out = np.zeros(REMOTE_COUNT)
    with node_directory() as directory:
        sender, receiver = remote_nodes(directory)
        with sender, receiver:
            assert finish(sender, moved(True, 1, data, tag=3), slice_s=0.5) == _core.REROUTED
            data[:] = -1.0
            assert finish(receiver, moved(False, 0, out, tag=3)) == _core.REROUTED
            assert receiver.remote_reads == 0 and not out.any()
            # The link goes on: the next message is read in place.
            got = in_thread(finish, receiver, moved(False, 0, out, tag=3))
            assert finish(sender, moved(True, 1, data, tag=3)) == _core.DONE
            assert got() == _core.DONE
    np.testing.assert_array_equal(out, -1.0)


def test_two_large_sends_to_each_other_go_over_the_transport_without_waiting_the_grace():
    """Both ranks send first: rank 0 sees rank 1's offer at the head of its ring while its own
    waits, declines it and takes its own back at once (within a slice shorter than the 1 ms
    grace), so both sends and then both receives end REROUTED, nothing read in place."""
    data = [np.arange(REMOTE_COUNT, dtype=np.float64) * (rank + 1) for rank in range(2)]
    out = [np.zeros(REMOTE_COUNT) for _ in range(2)]
    with node_directory() as directory:
        nodes = remote_nodes(directory)
        with nodes[0], nodes[1]:
            start(nodes[1], moved(True, 0, data[1], tag=3))
            assert nodes[1].progress(0.0) == _core.PENDING  # its offer is in the ring
            start(nodes[0], moved(True, 1, data[0], tag=3))
            assert nodes[0].progress(0.0) == _core.PENDING
            nodes[0].scan_incoming()  # opens the ring from rank 1, as between slices
            assert nodes[0].progress(0.0002) == _core.REROUTED
            assert finish(nodes[1]) == _core.REROUTED
            for rank in range(2):
                assert finish(nodes[rank], moved(False, 1 - rank, out[rank], tag=3)) \
                    == _core.REROUTED
                assert nodes[rank].remote_reads == 0 and not out[rank].any()


def test_a_ring_of_large_sends_does_not_wait_out_the_grace():
    """Three ranks each send to the next first. Ranks 0 and 1 find their receivers' bells
    saying that they wait on offers of their own, so they take their offers back at once
    (within a slice shorter than the 1 ms grace; their messages go over the transport). Rank
    2's receiver, rank 0, is then no longer in a send: rank 2 waits, and rank 0's receive
    reads its message in place."""
    data = [np.arange(REMOTE_COUNT, dtype=np.float64) * (rank + 1) for rank in range(3)]
    out = [np.zeros(REMOTE_COUNT) for _ in range(3)]
    with node_directory() as directory:
        nodes = [node(directory, rank, world=3, remote_min_bytes=1024) for rank in range(3)]
        with nodes[0], nodes[1], nodes[2]:
            for rank in range(3):
                start(nodes[rank], moved(True, (rank + 1) % 3, data[rank], tag=3))
                assert nodes[rank].progress(0.0) == _core.PENDING
            assert nodes[0].progress(0.0002) == _core.REROUTED
            assert nodes[1].progress(0.0002) == _core.REROUTED
            assert nodes[2].progress(0.0002) == _core.PENDING
            got = in_thread(finish, nodes[2])
            received = finish(nodes[0], moved(False, 2, out[0], tag=3))
            # Rank 0 reads in place unless this thread began its receive only after rank 2's
            # grace had run out (a loaded machine): then both sides end REROUTED alike.
            assert (received, got()) in ((_core.DONE, _core.DONE),
                                         (_core.REROUTED, _core.REROUTED))
            for rank in (1, 2):
                assert finish(nodes[rank], moved(False, rank - 1, out[rank], tag=3)) \
                    == _core.REROUTED
            in_place = received == _core.DONE
            assert [n.remote_reads for n in nodes] == [int(in_place), 0, 0]
    if in_place:
        np.testing.assert_array_equal(out[0], data[2])
    else:
        assert not out[0].any()
    assert not out[1].any() and not out[2].any()


@pytest.mark.parametrize("receiver_count", [REMOTE_COUNT, REMOTE_COUNT + 1])
def test_without_remote_reads_a_large_send_carries_only_its_header(receiver_count):
    """remote_min_bytes 0 (reads in place off): a large point-to-point message is framed as
    an offer already taken back, so the send ends REROUTED at once, and the receive either
    ends REROUTED or, for another size, finds the mismatch in the header it carries."""
    data = np.arange(REMOTE_COUNT, dtype=np.float64)
    out = np.zeros(receiver_count)
    with node_directory() as directory:
        sender, receiver = (node(directory, rank) for rank in range(2))
        with sender, receiver:
            start(sender, moved(True, 1, data, tag=3))
            assert sender.progress(0.0) == _core.REROUTED
            status = finish(receiver, moved(False, 0, out, tag=3))
            if receiver_count == REMOTE_COUNT:
                assert status == _core.REROUTED
            else:
                assert status == _core.MISMATCH
                details = receiver.mismatch_details()
                assert (details["reason"], details["count"]) == ("header", REMOTE_COUNT)
            assert receiver.remote_reads == 0 and not out.any()


def test_a_large_send_met_by_a_collective_is_declined_and_rerouted():
    """Rank 1 runs a collective receive from rank 0 when rank 0's large send on channel 3
    arrives first: rank 1 sets the offer aside and declines it, so the send ends REROUTED;
    rank 1's receive on channel 3 later ends REROUTED as well, having read nothing."""
    data = np.arange(REMOTE_COUNT, dtype=np.float64)
    out, small, small_out = np.zeros(REMOTE_COUNT), np.full(8, 7.0), np.zeros(8)
    with node_directory() as directory:
        sender, receiver = remote_nodes(directory)
        with sender, receiver:
            got = in_thread(finish, receiver, moved(False, 0, small_out))
            assert finish(sender, moved(True, 1, data, tag=3)) == _core.REROUTED
            assert finish(sender, moved(True, 1, small)) == _core.DONE
            assert got() == _core.DONE
            assert finish(receiver, moved(False, 0, out, tag=3)) == _core.REROUTED
            assert receiver.remote_reads == 0 and not out.any()
    np.testing.assert_array_equal(small_out, small)


def test_an_abandoned_offer_is_never_read():
    """The sender abandons its call while its offer waits: the receiver then finds it taken
    back, reads nothing from the sender's memory and waits for data that never comes."""
    data = np.arange(REMOTE_COUNT, dtype=np.float64)
    out = np.zeros(REMOTE_COUNT)
    with offering(data) as (sender, receiver):
        assert sender.progress(0.005) == _core.PENDING
        sender.abandon()
        start(receiver, moved(False, 0, out))
        assert receiver.progress(0.05) == _core.PENDING
        assert receiver.remote_reads == 0 and not out.any()
        receiver.abandon()


def test_an_offer_met_by_another_channel_is_declined_and_its_message_comes_through_the_ring():
    """Rank 1 receives on channel 5 first and meets rank 0's offer (a collective's, channel
    -1) on the way: it declines it and sets it aside; rank 0 then sends the message through
    the ring, and rank 1's collective receive later takes it from what was set aside."""
    data = np.arange(REMOTE_COUNT, dtype=np.float64)
    out = np.zeros(REMOTE_COUNT)
    p2p_data, p2p_out = np.full(8, 7.0), np.zeros(8)
    with node_directory() as directory:
        sender, receiver = remote_nodes(directory)
        with sender, receiver:
            got = in_thread(finish, receiver, moved(False, 0, p2p_out, tag=5))
            assert finish(sender, moved(True, 1, data)) == _core.DONE
            assert finish(sender, moved(True, 1, p2p_data, tag=5)) == _core.DONE
            assert got() == _core.DONE
            assert finish(receiver, moved(False, 0, out)) == _core.DONE
            assert receiver.remote_reads == 0
    np.testing.assert_array_equal(p2p_out, p2p_data)
    np.testing.assert_array_equal(out, data)


def test_an_offer_whose_cookie_is_wrong_is_denied_and_nothing_is_read():
    """A hostile REMOTE frame naming memory of this process with a cookie that is not there:
    the receiver refuses it (DENIED in the frame), reads nothing and waits for data."""
    secret = np.full(REMOTE_COUNT, 13.0)
    cookie_there = np.array([1234], np.uint64)
    out = np.zeros(REMOTE_COUNT)
    header = stamp("broadcast", "binomial", REMOTE_COUNT, root=0, op="").packed
    with node_directory() as directory:
        receiver = node(directory, 1, remote_min_bytes=1024)
        with receiver:
            start(receiver, moved(False, 0, out))
            assert receiver.progress(0) == _core.PENDING  # its rings exist now
            offer = np.array([1, os.getpid(), secret.ctypes.data, 4321,
                              cookie_there.ctypes.data], np.int64)
            payload_at = 64 + (len(header) + 7) // 8 * 8
            frame_bytes = (payload_at + offer.nbytes + 63) // 64 * 64
            head = np.array([3 | (len(header) << 32), frame_bytes, 0, -1, REMOTE_COUNT,
                             out.nbytes, 0, offer.nbytes], np.int64)
            frame = bytearray(frame_bytes)
            frame[:64] = head.tobytes().ljust(64, b"\0")
            frame[64:64 + len(header)] = header
            frame[payload_at:payload_at + offer.nbytes] = offer.tobytes()
            with open(os.path.join(directory, "ring-0-1"), "r+b") as ring:
                ring.seek(128)
                ring.write(frame)
                ring.seek(0)
                ring.write(np.array([frame_bytes], np.uint64).tobytes())
            assert receiver.progress(0.05) == _core.PENDING
            with open(os.path.join(directory, "ring-0-1"), "rb") as ring:
                ring.seek(128 + payload_at)
                state = int.from_bytes(ring.read(4), "little")
            assert state == 6  # RC_REMOTE_DENIED
            assert receiver.remote_reads == 0 and not out.any()
            receiver.abandon()


def test_bad_remote_min_bytes_is_refused():
    with node_directory() as directory, pytest.raises(ValueError, match="remote_min_bytes"):
        node(directory, 0, remote_min_bytes=-1)


def test_small_messages_touch_one_page_of_a_large_ring():
    """A producer that finds its ring empty restarts at offset 0 before leaving the first page:
    a thousand small allreduces leave a 1 MiB ring file with a single page in memory."""
    with node_directory() as directory:
        def rank_main(rank):
            with node(directory, rank, ring_bytes=1 << 20) as n:
                for seq in range(1000):
                    assert finish(n, allreduce(rank, seq=seq)) == _core.DONE
        other = in_thread(rank_main, 1)
        rank_main(0)
        other()
        for name in ("ring-0-1", "ring-1-0"):
            assert os.stat(os.path.join(directory, name)).st_blocks * 512 <= 4096


# -------------------------------------------------------------------------- mismatches

def mismatch_error(rank, call_stamp, count, details):
    return wire.mismatch(rank, details["peer"], call_stamp, 0, count, details["header"],
                         details["step"], details["count"])


@pytest.mark.parametrize("field", ["op", "count", "seq"])
def test_ranks_that_call_differently_both_get_a_mismatch_with_details(field):
    mine = {"op": ReduceOp.SUM, "count": 4, "seq": 0}
    theirs = dict(mine, **{field: {"op": ReduceOp.MAX, "count": 6, "seq": 1}[field]})
    with node_directory() as directory:
        results = both(directory, [allreduce(0, **mine), allreduce(1, **theirs)])
    for rank, (status, _, details), own, other in ((0, results[0], mine, theirs),
                                                   (1, results[1], theirs, mine)):
        assert status == _core.MISMATCH and details["peer"] == 1 - rank
        assert details["reason"] == "header"
        error = mismatch_error(rank, stamp(count=own["count"], seq=own["seq"],
                                           op=own["op"].name), own["count"], details)
        assert set(error.differences) == ({"count", "shape"} if field == "count" else {field})
        assert error.differences[field] == ((own[field].name, other[field].name)
                                            if field == "op" else (own[field], other[field]))


def test_another_collective_is_reported_by_the_rank_that_receives_it():
    """Rank 0 broadcasts from itself (a send only) while rank 1 allreduces: rank 1's receive
    gets rank 0's broadcast and names the collective and algorithm that differ."""
    count = 4
    broadcast = record(ALGORITHMS["broadcast"]["binomial"], Team.world(2, 0), np.float64,
                       count, Blocks.uniform(count, 2), 0)
    calls = [Call(encode_plan(broadcast), broadcast.slots(np.ones(count)),
                  stamp("broadcast", "binomial", count, root=0, op="").packed,
                  dtype_code("float64"), NO_OP), allreduce(1)]
    with node_directory() as directory:
        results = both(directory, calls)
    assert results[0][0] == _core.DONE
    status, _, details = results[1]
    assert status == _core.MISMATCH
    error = mismatch_error(1, stamp(count=count), count, details)
    assert {"collective", "algorithm", "root", "op"} <= set(error.differences)


def test_a_frame_of_this_call_with_another_header_is_a_mismatch_before_any_receive_from_it():
    """Rank 0 waits for rank 2 first; rank 1's message of the same call number but another op
    sits in its ring: rank 0 reports it without waiting for rank 2, who never comes."""
    count = 4
    plans = [
        Plan(None, [(Message(False, 2, 0, Place(0, 0, count), True),),
                    (Message(False, 1, 0, Place(0, 0, count), True),)], [], np.dtype("f8")),
        Plan(None, [(Message(True, 0, 0, Place(0, 0, count), False),)], [], np.dtype("f8")),
    ]
    ops = [ReduceOp.SUM, ReduceOp.MAX]
    with node_directory() as directory:
        def rank_main(rank):
            with node(directory, rank, world=3) as n:
                n.start(_core.Program(encode_plan(plans[rank]), dtype_code("float64"),
                                      op_code(ops[rank], "float64")),
                        plans[rank].slots(np.ones(count)),
                        stamp(count=count, op=ops[rank].name).packed)
                return finish(n), n.mismatch_details()
        sender = in_thread(rank_main, 1)
        status, details = rank_main(0)
        assert sender()[0] == _core.DONE
    assert status == _core.MISMATCH and details["peer"] == 1
    assert details["expected_step"] == -1 and details["expected_count"] == -1
    error = mismatch_error(0, stamp(count=count), count, details)
    assert error.differences == {"op": ("SUM", "MAX")}


def test_a_malformed_frame_is_a_mismatch_not_a_crash():
    with node_directory() as directory:
        with node(directory, 0) as n:
            start(n, allreduce(0))
            assert n.progress(0) == _core.PENDING  # its rings exist now
            with open(os.path.join(directory, "ring-1-0"), "r+b") as ring:
                ring.write(np.array([1 << 40], np.uint64).tobytes())  # head far beyond the tail
            assert finish(n) == _core.MISMATCH
            assert n.mismatch_details()["reason"] == "a malformed frame"


# ------------------------------------------------------------------ waiting and slices

def test_a_rank_whose_peer_never_comes_returns_pending_after_each_slice_then_finishes():
    with node_directory() as directory, node(directory, 0) as first:
        start(first, allreduce(0))
        for _ in range(3):
            started = time.monotonic()
            assert first.progress(0.05) == _core.PENDING
            assert time.monotonic() - started < HANG
        late = in_thread(second_rank_allreduce, directory)
        assert finish(first) == _core.DONE
        assert late() == _core.DONE


def second_rank_allreduce(directory):
    with node(directory, 1) as second:
        return finish(second, allreduce(1))


def test_a_sleeping_rank_is_woken_by_its_peer_not_by_the_end_of_its_slice():
    """Rank 0 has been through a whole slice without its peer (so it went to sleep) and waits
    again with a slice of HANG seconds: rank 1's message must wake it, and the call ends DONE
    long before the slice would."""
    with node_directory() as directory, node(directory, 0) as sleeper:
        start(sleeper, allreduce(0))
        assert sleeper.progress(0.05) == _core.PENDING
        waiting = threading.Event()

        def sleep_for_the_peer():
            waiting.set()
            started = time.monotonic()
            return sleeper.progress(HANG), time.monotonic() - started
        woken = in_thread(sleep_for_the_peer)
        assert waiting.wait(HANG)
        assert second_rank_allreduce(directory) == _core.DONE
        status, slept = woken()
        assert status == _core.DONE and slept < HANG / 2


def test_wake_all_returns_a_sleeper_at_once_and_only_once():
    with node_directory() as directory, node(directory, 0) as sleeper, \
            node(directory, 1) as waker:
        start(sleeper, allreduce(0))
        woken = in_thread(lambda: (time.monotonic(), sleeper.progress(HANG), time.monotonic()))
        waker.wake_all()
        started, status, ended = woken()
        assert status == _core.PENDING and ended - started < HANG / 2
        other = in_thread(finish, waker, allreduce(1))
        assert sleeper.progress(HANG) == _core.DONE  # the alarm was seen once, not again
        assert other() == _core.DONE


def _die_in_a_call(directory, ready):
    """Rank 1 waits for a broadcast from rank 0 (so it sends nothing) and is killed there."""
    with node(directory, 1) as n:
        plan = record(ALGORITHMS["broadcast"]["binomial"], Team.world(2, 1), np.float64, 4,
                      Blocks.uniform(4, 2), 0)
        n.start(_core.Program(encode_plan(plan), dtype_code("float64"), NO_OP),
                plan.slots(np.zeros(4)), stamp("broadcast", "binomial", root=0, op="").packed)
        ready.set()
        n.progress(HANG * 10)


def test_a_killed_peer_leaves_the_survivor_returning_pending():
    context = multiprocessing.get_context("spawn")
    with node_directory() as directory:
        ready = context.Event()
        peer = context.Process(target=_die_in_a_call, args=(directory, ready), daemon=True)
        peer.start()
        try:
            assert ready.wait(HANG)
            peer.kill()
            peer.join(HANG)
            with node(directory, 0) as survivor:
                start(survivor, allreduce(0))
                for _ in range(3):
                    started = time.monotonic()
                    assert survivor.progress(0.05) == _core.PENDING
                    assert time.monotonic() - started < HANG
                survivor.abandon()
                assert not survivor.active
        finally:
            peer.kill()


def test_busy_waiting_ranks_finish_too():
    with node_directory() as directory:
        results = both(directory, [allreduce(0), allreduce(1)], spin_ns=200_000)
    assert [r[0] for r in results] == [_core.DONE, _core.DONE]


# --------------------------------------------------------------- files and arguments

def test_the_directory_must_be_private():
    with node_directory() as directory:
        os.chmod(directory, 0o755)
        with pytest.raises(PermissionError, match="0700"):
            node(directory, 0)


def test_a_symlinked_ring_or_doorbell_is_refused():
    with node_directory() as directory, node_directory() as elsewhere:
        target = os.path.join(elsewhere, "target")
        open(target, "wb").close()
        os.symlink(target, os.path.join(directory, "ring-0-1"))
        with node(directory, 0) as n:
            with pytest.raises(OSError, match="ring-0-1"):
                start(n, allreduce(0))
            assert not n.active
        os.symlink(target, os.path.join(elsewhere, "doorbell"))
        with pytest.raises(OSError, match="doorbell"):
            node(elsewhere, 0)


@pytest.mark.skipif(os.geteuid() != 0, reason="making a file of another user needs root")
def test_a_ring_of_another_user_is_refused():
    with node_directory() as directory:
        path = os.path.join(directory, "ring-1-0")
        open(path, "wb").close()
        os.chown(path, 65534, 65534)
        with node(directory, 0) as n:
            with pytest.raises(PermissionError, match="another user"):
                start(n, allreduce(0))


def test_a_ring_of_another_size_or_open_to_others_is_refused():
    with node_directory() as directory:
        path = os.path.join(directory, "ring-0-1")
        with open(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600), "wb") as ring:
            ring.write(b"\0" * 4096)
        with node(directory, 0) as n, pytest.raises(OSError, match="size"):
            start(n, allreduce(0))
        os.chmod(path, 0o640)
        with node(directory, 0) as n, pytest.raises(PermissionError, match="group or others"):
            start(n, allreduce(0))


def bad_code(words):
    return np.array(words, np.int64)


@pytest.mark.parametrize("words, message", [
    ([], "step count"),
    ([1, 1, 1, 0, 0, 0, 0, 0, 4], "rank 0 "),
    ([1, 1, 1, 1, 5, 0, 0, 0, 4], "rank 5"),
    ([1, 1, 1, 1, 1, 0, 9, 0, 4], "slot 9"),
    ([1, 1, 1, 1, 1, 0, 0, 2, 9], "elements 2..9"),
    ([1, 1, 1, 3, 1, 0, 0, 0, 4], "flags 3"),
    ([1, 1, 2, 0, 1, 0, 0, 0, 4], "round of 2"),
    ([1, 2, 0, 0, 0, 1, 4, 1, 0, 0, 1, 4, -1], "reaches elements -3..0"),
    ([1, 2, 0, 0, 0, 1, 4, 1, 0, 0, 1, 4, 1 << 62], "overflows"),
    ([1, 2, 0, 0, 0, 0, 0, 0, 1, 4, 1], "dimensions"),
    ([1, 2, 0, 0, 0, 1, 4, 1, 0, 1, 1, 3, 1], "differ in shape"),
    ([1, 2, 1, 0, 0, 1, 4, 1, 0, 0, 1, 4, 1], "without a reduce op"),
    ([1, 7, 0], "kind 7"),
    ([2, 1, 0], "ends before step 1"),
    ([0, 0], "after its steps"),
])
def test_malformed_or_hostile_plan_code_is_refused_before_anything_runs(words, message):
    """Refused where the program is built (its code alone) or where a call of it starts (the
    call's slots, this rank and its world)."""
    with node_directory() as directory, node(directory, 0) as n:
        with pytest.raises(ValueError, match=message):
            program = _core.Program(bad_code(words), dtype_code("float64"), NO_OP)
            n.start(program, [np.zeros(4)], b"h")
        assert not n.active


def test_one_program_runs_calls_on_arrays_of_its_size_and_refuses_smaller_ones():
    """A program is checked once; each call's arrays are checked against what it reaches."""
    with node_directory() as directory, node(directory, 0, world=1) as alone:
        copy = Plan(None, [Local("copy", Place(2, 0, 4), Place(0, 0, 4))], [],
                    np.dtype(np.float64))
        program = _core.Program(encode_plan(copy), dtype_code("float64"), NO_OP)
        assert program.slots == 3
        for value in (1.0, 2.0):
            slots = [np.full(4, value), np.zeros(0), np.zeros(4)]
            alone.start(program, slots, b"")
            assert alone.progress(0) == _core.DONE
            np.testing.assert_array_equal(slots[2], np.full(4, value))
        with pytest.raises(ValueError, match="elements 0..3 of slot 2, which has 3"):
            alone.start(program, [np.ones(4), np.zeros(0), np.zeros(3)], b"")
        with pytest.raises(ValueError, match="slot 2 of 2"):
            alone.start(program, [np.ones(4), np.zeros(0)], b"")
        assert not alone.active


def test_bad_slots_and_codes_are_refused():
    with node_directory() as directory, node(directory, 0) as n:
        call = allreduce(0)
        program = call.program()
        with pytest.raises(ValueError, match="8-byte elements"):
            n.start(program, [np.zeros(4, np.float32)] + call.slots[1:], call.header)
        unaligned = np.zeros(33, np.uint8)[1:].view(np.float64)
        with pytest.raises(ValueError, match="aligned"):
            n.start(program, [unaligned] + call.slots[1:], call.header)
        read_only = call.slots[0].copy()
        read_only.flags.writeable = False
        with pytest.raises(ValueError, match="read-only"):
            n.start(program, [read_only] + call.slots[1:], call.header)
        with pytest.raises(TypeError, match="must be a Program"):
            n.start(call.code, call.slots, call.header)
        with pytest.raises(TypeError, match="int64"):
            _core.Program(call.code.astype(np.int32), call.dtype_code, call.op_code)
        with pytest.raises(ValueError, match="no reduction"):
            _core.Program(call.code, 99, call.op_code)
        with pytest.raises(RuntimeError, match="no call"):
            n.progress(0)
        start(n, call)
        with pytest.raises(RuntimeError, match="running"):
            start(n, call)
        n.abandon()
        assert not n.active


def test_a_header_too_long_for_the_ring_is_refused():
    with node_directory() as directory, node(directory, 0, ring_bytes=1024) as n:
        call = allreduce(0)
        with pytest.raises(ValueError, match="too small"):
            n.start(call.program(), call.slots, b"h" * 600)


@pytest.mark.parametrize("arguments", [
    dict(rank=2), dict(rank=-1), dict(world=0), dict(ring_bytes=1000), dict(ring_bytes=512),
    dict(part_bytes=8), dict(spin_ns=-1),
])
def test_bad_node_parameters_are_refused(arguments):
    with node_directory() as directory, pytest.raises(ValueError):
        node(directory, **{"rank": 0, **arguments})


def test_the_header_sequence_offset_is_the_wire_format_s():
    assert _core.HEADER_SEQ_OFFSET == CallHeader.SEQ_OFFSET

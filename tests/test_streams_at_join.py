"""Streams between nodes opened and authenticated at the join (``stream_carrier.open_at_join``):
which pairs (``peers_at_join``), one stream per pair known both ways before any message, the
first round of a call in the native core, and what a join raises when a peer refuses, fails
the handshake or never comes."""

import os
import threading

import numpy as np
import pytest

import ray_collective as col
from ray_collective import native
from ray_collective.backends.base import BackendFactory
from ray_collective.engine.cpu import TransportMembership
from ray_collective.errors import CollectiveTimeoutError, PeerDiedError
from ray_collective.testing import run_ranks
from ray_collective.transport.base import COLLECTIVE_TAG
from ray_collective.transport.stream_carrier import JOIN_ALL_PAIRS_MAX, peers_at_join
from support.helpers import numpy_reduce, rank_data
from test_tcp import KEY, pretend_nodes, two_node_transports

OTHER_KEY = b"k" * 16


def _open_all(transports, timeout=10.0):
    """Every rank's ``open_streams`` at once, one thread each; what each raised (or None)."""
    raised = [None] * len(transports)

    def open_one(rank):
        try:
            transports[rank].open_streams(timeout)
        except Exception as err:  # the test looks at it
            raised[rank] = err

    threads = [threading.Thread(target=open_one, args=(rank,)) for rank in range(len(transports))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout + 10)
    return raised


def _close(transports):
    for transport in transports:
        transport.close()


@pytest.mark.parametrize("nodes", [
    ["a", "a", "b", "b"],
    ["a", "b", "a", "b", "c", "c"],
    ["a"] * 5 + ["b"] * 5 + ["c"] * 2,
    ["a"] * 1 + ["b"] * 11,
    [node for node in "abcd" for _ in range(4)],
])
def test_the_pairs_opened_at_the_join_agree_on_both_ends_and_cross_nodes(nodes):
    pairs = {(rank, peer) for rank in range(len(nodes)) for peer in peers_at_join(nodes, rank)}
    assert all((peer, rank) in pairs for rank, peer in pairs)
    assert all(nodes[rank] != nodes[peer] for rank, peer in pairs)
    by_node = {node: [rank for rank, n in enumerate(nodes) if n == node] for node in nodes}
    leaders = [ranks[0] for ranks in by_node.values()]
    # The nodes' lowest ranks (the hierarchical algorithms' leaders) are always joined.
    assert all((a, b) in pairs for a in leaders for b in leaders if a != b)
    if len(nodes) <= JOIN_ALL_PAIRS_MAX:
        assert len(pairs) == sum(nodes[a] != nodes[b] for a in range(len(nodes))
                                 for b in range(len(nodes)))
    else:
        index = {rank: ranks.index(rank) for ranks in by_node.values() for rank in ranks}
        assert all(index[rank] == index[peer] for rank, peer in pairs)


def test_after_the_join_every_pair_across_nodes_has_one_stream_known_both_ways(tmp_path):
    p = 4
    transports = two_node_transports(tmp_path, p)
    try:
        assert _open_all(transports) == [None] * p
        nodes = pretend_nodes(p)
        for rank, transport in enumerate(transports):
            carrier = transport.stream_carrier
            others = [peer for peer in range(p) if nodes[peer] != nodes[rank]]
            streams = carrier.open_streams()
            assert sorted(stream.peer for stream in streams) == others
            assert all(stream.open for stream in streams)
            for peer in others:
                sending = carrier.sending_stream(peer)
                # Both ways on one stream, quiet: a round with the peer may go to the core.
                assert carrier.quiet_streams(peer, COLLECTIVE_TAG, True, True) == (sending,
                                                                                   sending)
        assert all(t.refused_connections == 0 for t in transports)
    finally:
        _close(transports)


def test_a_peer_that_refuses_the_connection_is_named_dead_by_the_join(tmp_path):
    transports = two_node_transports(tmp_path, 2)
    try:
        transports[1].stream_carrier.streams.listener.close()
        with pytest.raises(PeerDiedError) as raised:
            transports[0].open_streams(5.0)
        assert raised.value.dead_ranks == (1,)
        assert "init_collective_group" in str(raised.value)
    finally:
        _close(transports)


def test_a_peer_without_the_key_fails_the_join_on_both_ends(tmp_path):
    transports = two_node_transports(tmp_path, 2,
                                     key_of=lambda rank: OTHER_KEY if rank == 1 else KEY)
    try:
        raised = _open_all(transports, timeout=1.0)
        # The connecting end sees the proof fail: its peer is dead to it. The accepting end
        # refuses the response and never gets a stream from rank 0: its join times out.
        assert isinstance(raised[0], PeerDiedError) and raised[0].dead_ranks == (1,)
        assert isinstance(raised[1], CollectiveTimeoutError)
        assert raised[1].missing_ranks == (0,)
        assert transports[1].refused_connections == 1
    finally:
        _close(transports)


@pytest.mark.parametrize("waiting_rank", [0, 1])
def test_a_peer_that_never_joins_times_the_join_out_naming_it(tmp_path, waiting_rank):
    """Rank 0 connects (the peer's kernel accepts) and waits for a handshake that never
    comes; rank 1 waits for a connection that never comes."""
    transports = two_node_transports(tmp_path, 2)
    try:
        with pytest.raises(CollectiveTimeoutError) as raised:
            transports[waiting_rank].open_streams(0.3)
        assert raised.value.missing_ranks == (1 - waiting_rank,)
        assert raised.value.collective.startswith("init_collective_group")
    finally:
        _close(transports)


class JoinedFactory(BackendFactory):
    """Ranks on two pretend nodes on the native core, their streams opened at the join, and
    nothing read from them until every rank has joined (a barrier of threads)."""

    name = "joined-streams-test"

    def __init__(self, tmp_path, world_size, forced=None):
        from ray_collective.engine.native_runner import (CORE_SPIN_S, SLICE_S, NativeRunner,
                                                         native_node)
        from ray_collective.engine.stream_rounds import StreamRounds
        self.transports = two_node_transports(tmp_path, world_size)
        self.joined = threading.Barrier(world_size)
        self.runners = [None] * world_size
        self._make = (SLICE_S, CORE_SPIN_S, NativeRunner, native_node, StreamRounds)
        self.forced = forced or {}

    def available(self):
        return True

    def create(self, group_name, world_size, rank, timeout):
        slice_s, spin_s, runner_type, node_of_rank, stream_rounds = self._make
        transport = self.transports[rank]
        transport.open_streams(timeout)
        self.joined.wait(timeout)
        directory = os.path.dirname(transport.peers[rank].socket_path)
        self.runners[rank] = runner_type(
            node_of_rank(directory, rank, world_size), transport, slice_s, spans_nodes=True,
            streams=stream_rounds(native.core(), transport.stream_carrier, transport, slice_s,
                                  spin_s))
        return TransportMembership(group_name, transport, node_of=pretend_nodes(world_size),
                                   native=self.runners[rank], forced=self.forced)

    def rounds_in_core(self, rank):
        return self.runners[rank].streams.rounds_run


needs_core = pytest.mark.skipif(not native.available(),
                                reason=f"the native core is not built: {native.import_error()}")


@needs_core
def test_the_first_call_after_the_join_runs_its_round_between_nodes_in_the_core(tmp_path):
    """One rank per node: the allreduce's only round is between nodes. The streams were opened
    at the join, and nothing was read from them before the call: both ends run it in C."""
    p = 2
    factory = JoinedFactory(tmp_path, p)

    def body(rank):
        tensor = rank_data(rank, 5, np.float64)
        col.allreduce(tensor)
        return tensor, factory.rounds_in_core(rank)

    results = run_ranks(p, body, factory_of=lambda rank: factory, timeout=60)
    expected = numpy_reduce([rank_data(r, 5, np.float64) for r in range(p)], col.ReduceOp.SUM)
    for tensor, rounds_in_core in results:
        np.testing.assert_array_equal(tensor, expected)
        assert rounds_in_core == 1


@needs_core
def test_after_a_wait_that_read_a_stream_ahead_the_next_round_finds_it_quiet(tmp_path):
    """Rank 1 comes late to a hierarchical allreduce: its leader, rank 0, waits in the node's
    core for several slices, taking in what arrives meanwhile (rank 2's part of the round
    between nodes), so that round runs on the Python engine; it leaves nothing read ahead,
    and the next call's round between nodes goes back to the core."""
    p = 4
    factory = JoinedFactory(tmp_path, p, {"allreduce": "hierarchical"})
    between_calls = threading.Barrier(p)
    expected = numpy_reduce([rank_data(r, 5, np.float64) for r in range(p)], col.ReduceOp.SUM)

    def body(rank):
        outcome = []
        for call in range(2):
            if call == 0:
                between_calls.wait(30)
                if rank == 1:
                    threading.Event().wait(0.3)  # late: several of its leader's slices
            before = factory.rounds_in_core(rank)
            tensor = rank_data(rank, 5, np.float64)
            col.allreduce(tensor)
            np.testing.assert_array_equal(tensor, expected)
            carrier = factory.transports[rank].stream_carrier
            quiet = all(carrier.quiet_streams(stream.peer, COLLECTIVE_TAG, True, True)
                        is not None for stream in carrier.open_streams())
            outcome.append((factory.rounds_in_core(rank) - before, quiet))
            between_calls.wait(30)
        return outcome

    results = run_ranks(p, body, factory_of=lambda rank: factory, timeout=60)
    leaders = (0, 2)
    # Every stream is quiet again after each call, whatever ran on which engine.
    assert all(quiet for rank in range(p) for _, quiet in results[rank])
    assert results[0][0][0] == 0  # the wait took rank 2's part in: the Python engine ran it
    # The next call: its round between nodes in the core on the leaders (rounds that find a
    # stream read ahead by a wait of more than a slice still go to Python; none waits here).
    assert sum(results[rank][1][0] for rank in leaders) >= 1

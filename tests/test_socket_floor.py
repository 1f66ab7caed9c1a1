"""The bare-socket floor benchmark (``benchmarks.socket_floor``): its two exchange patterns on
socket pairs between threads, its timing summary, and a real run on a two-node local cluster
(in a subprocess, since a cluster cannot share the suite's Ray)."""

import json
import socket
import threading

import pytest

from benchmarks.socket_floor import (PATTERNS, WORLD_SIZE, counterpart_of, mate_of,
                                     receive_value, run_iterations, slowest_rank_p50)
from support.helpers import run_benchmark


def _wired_ranks():
    """Per rank, sockets to its node-mate and its counterpart (socket pairs)."""
    sockets = [{} for _ in range(WORLD_SIZE)]
    for rank in range(WORLD_SIZE):
        for peer in (mate_of(rank), counterpart_of(rank)):
            if peer > rank:
                sockets[rank][peer], sockets[peer][rank] = socket.socketpair()
    return sockets


@pytest.mark.parametrize("pattern", PATTERNS)
def test_every_rank_gets_the_sum_in_every_iteration(pattern):
    sockets = _wired_ranks()
    results, errors = [None] * WORLD_SIZE, []

    def rank_main(rank):
        try:
            results[rank] = run_iterations(pattern, rank, sockets[rank], 20)
        except BaseException as err:  # reported to the test below
            errors.append(err)

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(WORLD_SIZE)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors and all(not thread.is_alive() for thread in threads)
    for stamps in results:
        assert len(stamps) == 21 and stamps == sorted(stamps)
    for rank_sockets in sockets:
        for sock in rank_sockets.values():
            sock.close()


def test_the_summary_takes_the_slowest_rank_of_each_iteration_then_the_median():
    stamps = [[0.0, 1.0, 2.0, 10.0], [0.0, 3.0, 4.0, 5.0]]
    # iteration times: rank 0 (1, 1, 8), rank 1 (3, 1, 1); slowest (3, 1, 8); median 3
    assert slowest_rank_p50(stamps) == 3.0


def test_a_peer_that_closes_before_sending_is_an_error():
    mine, theirs = socket.socketpair()
    theirs.close()
    with pytest.raises(ConnectionError):
        receive_value(mine)
    mine.close()


@pytest.mark.multinode
def test_a_two_node_run_times_both_patterns(tmp_path):
    out = tmp_path / "floor.json"
    run_benchmark("benchmarks.socket_floor", "--iterations", "50", "--repeats", "1",
                  "--json", str(out))
    report = json.loads(out.read_text())
    assert set(report["p50_us"]) == set(PATTERNS)
    assert all(len(values) == 1 and values[0] > 0 for values in report["p50_us"].values())

"""The two engines a group runs its collectives on: the native core (C, ``ray_collective.native``)
and the pure-Python engine (the executor over the transport), which stays the reference and the
fallback. Both must give numpy's results, and the same bits as each other; every member of a
group runs the engine they agree on at the rendezvous.

The in-process tests run every rank as a thread, the native ones over one core node per rank
in a private directory; the Ray tests run the real ``ray`` backend in actors.
"""

import os
import shutil
import tempfile
import time

import numpy as np
import pytest

import ray_collective as col
from support.helpers import numpy_reduce, run_in
from ray_collective import native
from ray_collective.backends.local import LocalBackendFactory
from ray_collective.testing import run_ranks
from ray_collective.transport.local import LocalFabric

REQUIRE_NATIVE_VARIABLE = "RAY_COLLECTIVE_REQUIRE_NATIVE"

needs_native = pytest.mark.skipif(
    not native.available(), reason=f"the native core is not built: {native.import_error()}")


def test_the_native_core_is_built_where_it_is_required():
    """``make test`` (and so CI) sets RAY_COLLECTIVE_REQUIRE_NATIVE=1: an install whose C
    extension did not build must fail there, not fall back quietly."""
    if os.environ.get(REQUIRE_NATIVE_VARIABLE) != "1":
        pytest.skip(f"{REQUIRE_NATIVE_VARIABLE} is not 1: a missing native core is allowed here")
    assert native.available(), native.import_error()


@needs_native
def test_the_status_codes_are_the_cores_own():
    from ray_collective.native import _core, codes
    assert (codes.DONE, codes.PENDING, codes.MISMATCH, codes.REROUTED) == (
        _core.DONE, _core.PENDING, _core.MISMATCH, _core.REROUTED)


@pytest.fixture
def shm_directory():
    """A private directory on /dev/shm for one test's native rings, removed after it (the
    rings are files of up to megabytes each: left behind, hundreds of runs fill /dev/shm)."""
    directory = tempfile.mkdtemp(prefix="rc-engines-", dir="/dev/shm")
    os.chmod(directory, 0o700)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def _native_factory(world_size, directory):
    factory = LocalBackendFactory(LocalFabric(world_size, "default"), native_directory=directory)
    return lambda rank: factory


def _on_both_engines(world_size, body, shm_directory):
    """Run ``body`` on every rank natively and on the Python engine; check that every array it
    returns has the same bits on both; return the native results."""
    natively = run_ranks(world_size, body,
                         factory_of=_native_factory(world_size, shm_directory), timeout=60)
    in_python = run_ranks(world_size, body, timeout=60)
    for rank in range(world_size):
        for got, expected in zip(natively[rank], in_python[rank], strict=True):
            assert got.tobytes() == expected.tobytes()
    return natively


def _float_inputs(rank, length, dtype, op=col.ReduceOp.SUM):
    """Floats that round: the order of a sum or product shows in its bits (factors near 1, so
    that a product of several stays finite)."""
    rng = np.random.default_rng(4242 + rank)
    if op is col.ReduceOp.PRODUCT:
        return rng.uniform(0.5, 2.0, length).astype(dtype)
    return (rng.standard_normal(length) * 10 ** rng.uniform(-3, 3, length)).astype(dtype)


def _every_collective(rank, world_size, dtype, length, op, group="default"):
    mine = _float_inputs(rank, length, dtype, op)
    out = {}
    x = mine.copy()
    col.allreduce(x, group, op)
    out["allreduce"] = x
    x = mine.copy()
    col.reduce(x, world_size - 1, group, op)
    out["reduce"] = x
    x = mine.copy()
    col.broadcast(x, 0, group)
    out["broadcast"] = x
    gathered = [np.empty_like(mine) for _ in range(world_size)]
    col.allgather(gathered, mine, group)
    out["allgather"] = np.concatenate(gathered)
    x = np.empty_like(mine)
    col.reducescatter(x, [_float_inputs(rank * 100 + j, length, dtype, op)
                          for j in range(world_size)], group, op)
    out["reducescatter"] = x
    received = [np.empty_like(mine) for _ in range(world_size)]
    col.alltoall(received, [mine + j for j in range(world_size)], group)
    out["alltoall"] = np.concatenate(received)
    gathered = [np.zeros_like(mine) for _ in range(world_size)]
    col.gather(gathered if rank == world_size - 1 else None, mine, world_size - 1, group)
    out["gather"] = np.concatenate(gathered)
    x = np.zeros_like(mine)
    col.scatter(x, [mine * j for j in range(world_size)] if rank == 0 else None, 0, group)
    out["scatter"] = x
    col.barrier(group)
    return out


@needs_native
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("dtype, length, op", [
    ("float32", 1000, col.ReduceOp.SUM), ("float64", 7, col.ReduceOp.AVG),
    ("float32", 300_001, col.ReduceOp.SUM), ("float64", 0, col.ReduceOp.MAX),
    ("float16", 513, col.ReduceOp.PRODUCT)])
def test_native_and_python_engines_agree_bit_for_bit_and_with_numpy(shm_directory, world_size,
                                                                    dtype, length,
                                                                    op):
    def body(rank):
        first = _every_collective(rank, world_size, dtype, length, op)
        again = _every_collective(rank, world_size, dtype, length, op)  # shapes known now
        for name, result in first.items():
            assert result.tobytes() == again[name].tobytes(), name
        return again

    natively = run_ranks(world_size, body,
                         factory_of=_native_factory(world_size, shm_directory), timeout=60)
    in_python = run_ranks(world_size, body, timeout=60)
    for rank in range(world_size):
        for name, result in natively[rank].items():
            assert result.tobytes() == in_python[rank][name].tobytes(), (rank, name)
    inputs = [_float_inputs(r, length, dtype, op) for r in range(world_size)]
    expected = numpy_reduce(inputs, op)
    # Each rank's order of operations differs from numpy's: the error of a sum is bounded by
    # (p - 1) roundings of the largest magnitude; a product of p by p roundings of it.
    eps = float(np.finfo(dtype).eps)
    largest = max((float(np.max(np.abs(x))) for x in inputs if x.size), default=0.0)
    atol = 2 * world_size * eps * (largest ** world_size if op is col.ReduceOp.PRODUCT
                                   else largest)
    for rank in range(world_size):
        np.testing.assert_allclose(natively[rank]["allreduce"], expected,
                                   rtol=world_size * eps, atol=atol)
        np.testing.assert_array_equal(natively[rank]["broadcast"], inputs[0])
        np.testing.assert_array_equal(natively[rank]["allgather"], np.concatenate(inputs))
        np.testing.assert_array_equal(natively[rank]["scatter"], inputs[0] * rank)
    np.testing.assert_array_equal(natively[world_size - 1]["gather"], np.concatenate(inputs))


@needs_native
@pytest.mark.parametrize("world_size", [2, 4, 5])
def test_a_large_allgather_receives_into_its_list_unless_the_entries_overlap(shm_directory,
                                                                             world_size):
    """Large blocks go straight into the caller's list (no buffer); a list whose entries
    share memory takes the buffer, as the Python engine does, the last entry written last."""
    from ray_collective.engine.native_runner import DIRECT_BLOCK_BYTES
    length = DIRECT_BLOCK_BYTES // 4 + 3

    def body(rank):
        mine = _float_inputs(rank, length, "float32")
        separate = [np.zeros(length, np.float32) for _ in range(world_size)]
        col.allgather(separate, mine)
        shared = np.zeros(length + 1, np.float32)
        overlapping = [shared[1:]] + [shared[:-1]] * (world_size - 1)
        col.allgather(overlapping, mine)
        aliased = np.zeros(length, np.float32)
        col.allgather([np.zeros(length, np.float32) for _ in range(world_size - 1)] + [mine],
                      mine)                              # the tensor is its own entry
        col.allgather([aliased] * world_size, mine)
        return np.concatenate(separate), shared, aliased, mine

    natively = run_ranks(world_size, body,
                         factory_of=_native_factory(world_size, shm_directory), timeout=60)
    in_python = run_ranks(world_size, body, timeout=60)
    inputs = [_float_inputs(r, length, "float32") for r in range(world_size)]
    for rank in range(world_size):
        separate, shared, aliased, mine = natively[rank]
        np.testing.assert_array_equal(separate, np.concatenate(inputs))
        np.testing.assert_array_equal(aliased, inputs[-1])
        np.testing.assert_array_equal(mine, inputs[-1])  # its entry got rank p-1's block
        for got, expected in zip(natively[rank], in_python[rank]):
            assert got.tobytes() == expected.tobytes()


@needs_native
@pytest.mark.parametrize("world_size", [2, 4])
def test_large_gather_and_scatter_agree_on_both_engines_at_every_root(shm_directory,
                                                                     world_size):
    """Blocks past DIRECT_BLOCK_BYTES: where the plan allows, the core sends from and
    receives into the caller's arrays (gather: at 2 ranks both ranks, at 4 the leaves of the
    tree; scatter, linear there: every rank); scatter's root may pass its tensor as its own
    entry."""
    from ray_collective.engine.native_runner import DIRECT_BLOCK_BYTES
    length = DIRECT_BLOCK_BYTES // 8 + 5

    def body(rank):
        out = []
        mine = _float_inputs(rank, length, "float64")
        for root in (0, world_size - 1):
            for _ in range(2):
                into = [np.zeros(length) for _ in range(world_size)]
                col.gather(into if rank == root else None, mine, root)
                out.append(np.concatenate(into))
                part = np.zeros(length)
                entries = [mine * (j + 1) for j in range(world_size)]
                col.scatter(part, entries if rank == root else None, root)
                out.append(part)
                own = mine * (rank + 1)
                entries[rank] = own
                col.scatter(own, entries if rank == root else None, root)
                out.append(own)
        return out

    natively = _on_both_engines(world_size, body, shm_directory)
    inputs = [_float_inputs(r, length, "float64") for r in range(world_size)]
    for rank in range(world_size):
        results = iter(natively[rank])
        for root in (0, world_size - 1):
            for _ in range(2):
                gathered = next(results)
                if rank == root:
                    np.testing.assert_array_equal(gathered, np.concatenate(inputs))
                else:
                    assert not gathered.any()
                np.testing.assert_array_equal(next(results), inputs[root] * (rank + 1))
                np.testing.assert_array_equal(next(results), inputs[root] * (rank + 1))


@needs_native
@pytest.mark.parametrize("world_size", [2, 4])
def test_a_large_reducescatter_agrees_on_both_engines_whatever_its_tensor_aliases(
        shm_directory, world_size):
    """Blocks past DIRECT_BLOCK_BYTES: at 2 ranks the core sends from the list and reduces
    into the tensor itself (4 ranks forward partial sums through the buffer). The tensor may
    be a separate array, this rank's own entry, or another rank's entry (which it is sent
    from: the buffered plan then runs); SUM and AVG."""
    from ray_collective.engine.native_runner import DIRECT_BLOCK_BYTES
    length = DIRECT_BLOCK_BYTES // 8 + 5

    def entries_of(rank):
        return [_float_inputs(rank * 10 + j, length, "float64") for j in range(world_size)]

    def body(rank):
        out = []
        for op in (col.ReduceOp.SUM, col.ReduceOp.AVG):
            for aliased in (None, rank, (rank + 1) % world_size):
                entries = entries_of(rank)
                tensor = np.zeros(length) if aliased is None else entries[aliased]
                col.reducescatter(tensor, entries, op=op)
                out.append(tensor.copy())
        return out

    natively = _on_both_engines(world_size, body, shm_directory)
    for rank in range(world_size):
        total = np.sum([entries_of(r)[rank] for r in range(world_size)], axis=0)
        for index, got in enumerate(natively[rank]):
            expected = total if index < 3 else total / world_size
            np.testing.assert_allclose(got, expected, rtol=1e-12)


@needs_native
@pytest.mark.parametrize("world_size, algorithm", [(2, "pairwise"), (3, "pairwise"),
                                                   (4, "pairwise"), (3, "bruck"), (4, "bruck"),
                                                   (3, "linear"), (4, "linear")])
@pytest.mark.parametrize("blocks", ["small", "large"])
def test_alltoall_agrees_on_both_engines_whatever_its_lists_alias(shm_directory, monkeypatch,
                                                                   world_size, algorithm,
                                                                   blocks):
    """Alltoall of 2-D blocks, small and past DIRECT_BLOCK_BYTES (where pairwise sends from
    the inputs and receives into the outputs themselves), three calls each (the first by the
    full path, the others by the known-shape path): separate lists, read-only inputs, the
    outputs being the inputs (in place: the buffered plan runs), and one array for every
    output (the last block written last, as on the Python engine)."""
    from ray_collective.engine.native_runner import DIRECT_BLOCK_BYTES
    monkeypatch.setenv("RAY_COLLECTIVE_ALGORITHM", f"alltoall={algorithm}")
    rows = 2 if blocks == "small" else DIRECT_BLOCK_BYTES // 16 + 3

    def block(source, target, call):
        return np.full((rows, 2), source * 100.0 + target + call / 8) + np.arange(rows * 2
                                                                                ).reshape(rows, 2)

    def body(rank):
        out = []
        for call in range(3):
            inputs = [block(rank, j, call) for j in range(world_size)]
            outputs = [np.zeros((rows, 2)) for _ in range(world_size)]
            col.alltoall(outputs, inputs)
            out.append(np.stack(outputs))
            read_only = [entry.copy() for entry in inputs]
            for entry in read_only:
                entry.setflags(write=False)
            outputs = [np.zeros((rows, 2)) for _ in range(world_size)]
            col.alltoall(outputs, read_only)
            out.append(np.stack(outputs))
            in_place = [entry.copy() for entry in inputs]
            col.alltoall(in_place, in_place)
            out.append(np.stack(in_place))
            one = np.zeros((rows, 2))
            col.alltoall([one] * world_size, inputs)
            out.append(one)
        return out

    natively = _on_both_engines(world_size, body, shm_directory)
    for rank in range(world_size):
        results = iter(natively[rank])
        for call in range(3):
            expected = np.stack([block(source, rank, call) for source in range(world_size)])
            for _ in range(3):
                np.testing.assert_array_equal(next(results), expected)
            np.testing.assert_array_equal(next(results), expected[-1])


def test_only_written_arrays_may_not_share_memory():
    """A call runs on the caller's arrays unless a written one shares memory with another
    array; arrays that are only read may share (``[x] * p`` as an input list)."""
    from ray_collective.engine.native_runner import entries_overlap
    whole = np.zeros(100)
    a, b, inside = whole[:50], whole[50:], whole[10:20]
    assert not entries_overlap([a, b])
    assert entries_overlap([a, inside])
    assert entries_overlap([whole[:51], b])                # one element in common
    assert not entries_overlap([a], [b, b, b])             # repeated inputs
    assert entries_overlap([b], [a, inside, whole[49:60]])  # a read span reaching a written one
    assert entries_overlap([inside], [whole])              # a written span inside a read one
    assert not entries_overlap([whole[0:0], whole[0:0]], [a])  # empty arrays hold nothing
    assert not entries_overlap([], [a, a])


@needs_native
@pytest.mark.parametrize("world_size", [2, 4])
def test_a_repeated_input_array_runs_on_the_callers_arrays_with_the_same_bits(
        shm_directory, monkeypatch, world_size):
    """An input list of one array repeated (``[x] * p``, large blocks): alltoall, scatter's
    root and reducescatter (pairwise, as on one node) still send from it without the
    buffer, and agree with the Python engine and numpy."""
    from ray_collective.engine.native_runner import DIRECT_BLOCK_BYTES, NativeRunner
    length = DIRECT_BLOCK_BYTES // 8 + 5
    monkeypatch.setenv("RAY_COLLECTIVE_ALGORITHM", "reducescatter=pairwise")
    direct = []
    run = NativeRunner.run

    def spy(self, native, *args, **kwargs):
        direct.append(native.buffered is not None)
        return run(self, native, *args, **kwargs)

    monkeypatch.setattr(NativeRunner, "run", spy)

    def body(rank):
        mine = _float_inputs(rank, length, "float64")
        exchanged = [np.zeros(length) for _ in range(world_size)]
        col.alltoall(exchanged, [mine] * world_size)
        part = np.zeros(length)
        col.scatter(part, [mine] * world_size if rank == 0 else None, 0)
        reduced = np.zeros(length)
        col.reducescatter(reduced, [mine] * world_size)
        return [*exchanged, part, reduced]

    natively = _on_both_engines(world_size, body, shm_directory)
    assert direct and all(direct), direct
    inputs = [_float_inputs(r, length, "float64") for r in range(world_size)]
    for rank in range(world_size):
        *exchanged, part, reduced = natively[rank]
        for source in range(world_size):
            np.testing.assert_array_equal(exchanged[source], inputs[source])
        np.testing.assert_array_equal(part, inputs[0])
        np.testing.assert_allclose(reduced, np.sum(inputs, axis=0), rtol=1e-12)


def _spanning_factory(node_of, directory):
    """Ranks on pretend nodes (``node_of``), with the native core when ``directory`` is
    given: one directory per node, the transport between nodes."""
    factory = LocalBackendFactory(LocalFabric(len(node_of), "default"), node_of=node_of,
                                  native_directory=directory)
    return lambda rank: factory


@needs_native
@pytest.mark.parametrize("node_of", [(0, 0, 1, 1), (0, 1, 1, 1, 2, 2), (1, 0, 0, 1, 1)])
def test_a_group_across_nodes_runs_its_node_rounds_on_the_core_with_the_same_bits(
        shm_directory, node_of):
    """Every collective, and sends and recvs within and between nodes, twice (the second time
    by the known-shape path): the node-aware algorithms' rounds within a node run on the
    core, the rest over the transport, with the Python engine's bits. Rings join only ranks
    of one node, and every node with several ranks has some."""
    from ray_collective.native._core import P2P_MAX_BYTES
    world_size = len(node_of)
    dtype, length, op = "float64", 1003, col.ReduceOp.SUM

    def body(rank):
        out = []
        for _ in range(2):
            out += list(_every_collective(rank, world_size, dtype, length, op).values())
            for big in (False, True):
                size = P2P_MAX_BYTES // 8 + 1 if big else 5
                message = np.arange(size, dtype=np.float64) + rank
                for peer in range(world_size):
                    if peer == rank:
                        continue
                    first = rank < peer
                    got = np.zeros(size)
                    if first:
                        col.send(message, peer)
                        col.recv(got, peer)
                    else:
                        col.recv(got, peer)
                        col.send(message, peer)
                    out.append(got)
        return out

    natively = run_ranks(world_size, body, factory_of=_spanning_factory(node_of, shm_directory),
                         timeout=60)
    in_python = run_ranks(world_size, body, factory_of=_spanning_factory(node_of, None),
                          timeout=60)
    inputs = [_float_inputs(r, length, dtype, op) for r in range(world_size)]
    for rank in range(world_size):
        for got, expected in zip(natively[rank], in_python[rank], strict=True):
            assert got.tobytes() == expected.tobytes()
        np.testing.assert_allclose(natively[rank][0], np.sum(inputs, axis=0), rtol=1e-12)
        np.testing.assert_array_equal(natively[rank][2], inputs[0])
    for node in set(node_of):
        rings = {name for name in os.listdir(os.path.join(shm_directory, f"node-{node}"))
                 if name.startswith("ring-")}
        here = {r for r in range(world_size) if node_of[r] == node}
        for name in rings:
            _, sender, receiver = name.split("-")
            assert {int(sender), int(receiver)} <= here, name
        assert bool(rings) == (len(here) > 1), (node, rings)


@needs_native
@pytest.mark.parametrize("forced", [None, "hierarchical_pipeline"])
def test_large_calls_across_nodes_agree_on_both_engines(shm_directory, monkeypatch, forced):
    """On 4 nodes of 2: a broadcast of 4 MiB goes by the leaders' tree where the core runs the
    rounds within nodes, down the node chain in Python (``hierarchical_pipeline``), or down the
    chain over the transport as a whole where forced on the core (its leaders' rounds mix the
    two ways); an allreduce of 16 MiB goes by shards (``hierarchical_sharded``, cut by way).
    Every way gives the Python engine's bits, and numpy's."""
    from ray_collective.algorithms.selector import (PIPELINE_BROADCAST_MIN_BYTES,
                                                    SHARDED_ALLREDUCE_MIN_BYTES)
    if forced is not None:
        monkeypatch.setenv("RAY_COLLECTIVE_ALGORITHM", f"broadcast={forced}")
    node_of = (0, 0, 1, 1, 2, 2, 3, 3)

    def body(rank):
        x = np.arange(PIPELINE_BROADCAST_MIN_BYTES // 2, dtype=np.float64) * (rank + 1)
        col.broadcast(x, 3)
        y = np.full(SHARDED_ALLREDUCE_MIN_BYTES // 4, rank + 0.5, np.float32)
        col.allreduce(y)
        return x, y, [call["algorithm"] for call in col.get_collective_trace()]

    natively = run_ranks(8, body, factory_of=_spanning_factory(node_of, shm_directory),
                         timeout=120)
    in_python = run_ranks(8, body, factory_of=_spanning_factory(node_of, None), timeout=120)
    for rank in range(8):
        x, y, algorithms = natively[rank]
        np.testing.assert_array_equal(x, np.arange(x.size, dtype=np.float64) * 4)
        np.testing.assert_array_equal(y, np.full(y.size, 32.0, np.float32))
        for got, expected in zip(natively[rank][:2], in_python[rank][:2], strict=True):
            assert got.tobytes() == expected.tobytes()
        assert algorithms == [forced or "hierarchical", "hierarchical_sharded"]
        assert in_python[rank][2] == [forced or "hierarchical_pipeline", "hierarchical_sharded"]


@needs_native
@pytest.mark.parametrize("calls", [("allreduce", "allgather"), ("broadcast", "scatter"),
                                   ("reduce", "gather"), ("allgather", "allreduce")])
def test_ranks_across_nodes_that_disagree_on_the_way_meet_a_mismatch_at_once(shm_directory,
                                                                           calls):
    """Rank 1 calls another collective than the others; one of the two runs its rounds
    within a node on the core (the hierarchical allreduce, broadcast and reduce), the other
    over the transport. Each way looks at the other while it waits: rank 0 waits in the core
    for rank 1, whose part came over the transport (the first and third cases), or waits on
    the transport while rank 1's part waits in the core's ring (the last); rank 1 waits on
    the transport while rank 0's part waits in the core's ring (the second). A rank finds
    the mismatch, and none waits long for the deadline (a rank whose part needs no one, as
    a broadcast's root or a gather's leaf, finishes). Each pair is one where the rank that
    must find it cannot finish first: where it could (reduce against barrier: rank 2 may
    finish its reduce before rank 1's barrier part reaches it), finding it is down to timing
    on both engines. (Where no
    rank ever sends to one that waits, as when rank 1 waits in a scatter for a root that
    waits for it in an allreduce, both engines meet the deadline alike.)"""
    node_of = (0, 0, 1, 1)
    others, odd = calls

    def call(name):
        x = np.ones(4)
        if name == "allreduce":
            col.allreduce(x, timeout=20)
        elif name == "broadcast":
            col.broadcast(x, 0, timeout=20)
        elif name == "allgather":
            col.allgather([np.zeros(4) for _ in node_of], x, timeout=20)
        elif name == "reduce":
            col.reduce(x, 0, timeout=20)
        elif name == "scatter":
            col.scatter(x, None, 0, timeout=20)
        else:
            col.gather(None, x, 0, timeout=20)

    def body(rank):
        started = time.monotonic()
        try:
            call(odd if rank == 1 else others)
        except (col.CollectiveMismatchError, col.GroupBrokenError) as error:
            return time.monotonic() - started, type(error)
        return time.monotonic() - started, None  # its part of the call needed no one else

    outcome = run_ranks(4, body, factory_of=_spanning_factory(node_of, shm_directory),
                        timeout=60)
    assert max(seconds for seconds, _ in outcome) < 5, outcome
    assert col.CollectiveMismatchError in {kind for _, kind in outcome}, outcome


@needs_native
@pytest.mark.parametrize("world_size", [2, 3])
def test_list_collectives_of_two_dimensional_tensors_agree_on_both_engines(shm_directory,
                                                                          world_size):
    """Gather, scatter, allgather and reducescatter (AVG) of 3x2 tensors, three times each
    (the first by the full path, the others by the known-shape path, whose native runner
    hands the core the arrays unflattened), at every root."""
    def body(rank):
        out = []
        for call in range(3):
            mine = np.arange(6.0).reshape(3, 2) * (rank + 1) + call
            for root in range(world_size):
                into = [np.full((3, 2), -1.0) for _ in range(world_size)]
                col.gather(into if rank == root else None, mine, root)
                out.append(np.stack(into))
                part = np.zeros((3, 2))
                col.scatter(part, [mine + 10 * j for j in range(world_size)]
                            if rank == root else None, root)
                out.append(part)
            gathered = [np.zeros((3, 2)) for _ in range(world_size)]
            col.allgather(gathered, mine)
            out.append(np.stack(gathered))
            reduced = np.zeros((3, 2))
            col.reducescatter(reduced, [mine * (j + 1) for j in range(world_size)],
                              op=col.ReduceOp.AVG)
            out.append(reduced)
        return out

    natively = _on_both_engines(world_size, body, shm_directory)
    for rank in range(world_size):
        results = iter(natively[rank])
        for call in range(3):
            inputs = [np.arange(6.0).reshape(3, 2) * (r + 1) + call for r in range(world_size)]
            for root in range(world_size):
                gathered = next(results)
                if rank == root:
                    np.testing.assert_array_equal(gathered, np.stack(inputs))
                else:
                    assert (gathered == -1.0).all()
                np.testing.assert_array_equal(next(results), inputs[root] + 10 * rank)
            np.testing.assert_array_equal(next(results), np.stack(inputs))
            np.testing.assert_allclose(next(results),
                                       sum(inputs) * (rank + 1) / world_size, rtol=1e-15)


@needs_native
def test_a_read_only_input_is_sent_from_but_never_written(shm_directory):
    """A reduce's input on a rank that gets no result may be read-only (Ray hands actors
    read-only arrays); a plan that would write into it is refused before anything is sent."""
    from ray_collective.native import _core, codes
    from ray_collective.engine.plan import point_to_point
    from ray_collective.transport.wire import CallHeader

    def body(rank):
        x = np.full(8, rank + 1.0)
        if rank != 2:
            x.setflags(write=False)
        col.reduce(x, 2)
        return x.copy()

    with tempfile.TemporaryDirectory(dir=shm_directory) as calls:
        assert run_ranks(3, body, factory_of=_native_factory(3, calls))[2].tolist() == [6.0] * 8
    directory = shm_directory
    frozen = np.zeros(4)
    frozen.setflags(write=False)
    receive = point_to_point(False, 1, 4, np.dtype(np.float64))
    header = CallHeader("g", 0, 0, "send/recv", "direct", "float64", 4, (4,)).pack()
    with _core.Node(directory, 0, 2, 1 << 16, 1 << 12, 0) as node:
        with pytest.raises(ValueError, match="read-only"):
            node.start(_core.Program(codes.encode_plan(receive), codes.dtype_code("float64"),
                                     codes.NO_OP), receive.slots(frozen), header, 0)


@needs_native
def test_a_native_call_that_disagrees_is_a_mismatch_on_every_rank(shm_directory):
    def body(rank):
        col.allreduce(np.ones(4))
        if rank == 0:
            col.allreduce(np.ones(4), op=col.ReduceOp.MAX)
        else:
            col.allreduce(np.ones(4))

    outcome = run_ranks(2, body, factory_of=_native_factory(2, shm_directory),
                        return_exceptions=True,
                        timeout=10)
    assert all(isinstance(err, col.CollectiveMismatchError) for err in outcome), outcome
    assert all(err.differences.get("op") for err in outcome)


@needs_native
@pytest.mark.parametrize("collective, call", [
    ("allreduce", lambda: col.allreduce(np.ones(4), timeout=0.5)),
    ("recv", lambda: col.recv(np.ones(4), 1, tag=1, timeout=0.5))])
def test_a_native_call_whose_peer_never_comes_times_out_naming_it(shm_directory, collective,
                                                                   call):
    """A collective, and a recv on the core whose sender never sends."""
    def body(rank):
        if rank == 1:
            return None
        with pytest.raises(col.CollectiveTimeoutError) as caught:
            call()
        return caught.value

    error, _ = run_ranks(2, body, factory_of=_native_factory(2, shm_directory), timeout=30)
    assert list(error.missing_ranks) == [1] and error.collective == collective


# ------------------------------------------------------------------ send and recv


def _core_tags(monkeypatch):
    """The tag of every call the native core runs from now on (a list that fills up)."""
    from ray_collective.engine.native_runner import NativeRunner
    tags = []
    run = NativeRunner.run

    def spy(self, native_plan, slots, template, seq, timeout, what, tag=-1):
        tags.append(tag)
        return run(self, native_plan, slots, template, seq, timeout, what, tag)

    monkeypatch.setattr(NativeRunner, "run", spy)
    return tags


@needs_native
@pytest.mark.parametrize("world_size", [2, 3])
def test_send_and_recv_agree_on_both_engines_between_collectives(shm_directory, world_size,
                                                                  monkeypatch):
    """Messages up to ``P2P_MAX_BYTES`` go through the core's rings on their tag, larger ones
    are read in place or, when both ranks send first, over the transport behind their offer,
    interleaved with collectives whose rings carry them: every message arrives in order per
    tag with the Python engine's bits, the second time round through the known-shape path."""
    from ray_collective.native._core import P2P_MAX_BYTES
    sizes = [1, 7, P2P_MAX_BYTES // 8, P2P_MAX_BYTES // 8 + 1, 300_000]

    def body(rank):
        last = world_size - 1
        out = []
        for round_ in range(2):
            for tag in (0, 5):
                for count in sizes:
                    mine = _float_inputs(rank * 10 + tag + round_, count, "float64")
                    mine.setflags(write=round_ == 0)  # a send may read a read-only array
                    if rank == 0:
                        col.send(mine, last, tag=tag)
                    elif rank == last:
                        got = np.empty(count)
                        col.recv(got, 0, tag=tag)
                        out.append(got)
                    x = mine[:3].copy()
                    col.allreduce(x)
                    out.append(x)
            # Both directions at once: each rank sends before it receives, at every size.
            for count in sizes:
                if rank in (0, last):
                    peer = last - rank
                    col.send(_float_inputs(rank + 50, count, "float64"), peer, tag=9)
                    got = np.empty(count)
                    col.recv(got, peer, tag=9)
                    out.append(got)
        return out

    tags = _core_tags(monkeypatch)
    natively = _on_both_engines(world_size, body, shm_directory)
    # A send and a recv per message, whatever its size.
    assert tags.count(0) == tags.count(5) == 2 * 2 * len(sizes)
    assert tags.count(9) == 2 * 2 * 2 * len(sizes)
    results = iter(natively[world_size - 1])
    for round_ in range(2):
        for tag in (0, 5):
            for count in sizes:
                np.testing.assert_array_equal(next(results),
                                              _float_inputs(tag + round_, count, "float64"))
                next(results)  # the allreduce
        for count in sizes:
            np.testing.assert_array_equal(next(results), _float_inputs(50, count, "float64"))


@needs_native
def test_a_large_send_is_read_in_place_when_its_receiver_waits_else_rerouted(shm_directory):
    """1 MiB between two ranks of a node: rank 1 waits in its recv first, so it reads rank 0's
    message from rank 0's memory (one copy, no transport); then both send before they
    receive, so neither send is read within its grace and both messages go over the
    transport, but for the one that a rank whose grace ended first may still find offered
    (a send ends only once its message was read or taken back, so never both). The bits are
    the sent ones either way."""
    count = (1 << 20) // 8

    def body(rank):
        from ray_collective.group import current_registry
        node = current_registry().get("default").membership.native.node
        mine, got = _float_inputs(rank + 1, count, "float64"), np.zeros(count)
        if rank == 0:
            time.sleep(0.2)  # rank 1 is in its recv by then
            col.send(mine, 1)
        else:
            col.recv(got, 0)
        reads_waited = node.remote_reads
        col.barrier()
        other = np.zeros(count)
        col.send(mine, 1 - rank)
        col.recv(other, 1 - rank)
        return got, other, reads_waited, node.remote_reads

    results = run_ranks(2, body, factory_of=_native_factory(2, shm_directory), timeout=60)
    (_, other0, waited0, after0), (got1, other1, waited1, after1) = results
    np.testing.assert_array_equal(got1, _float_inputs(1, count, "float64"))
    np.testing.assert_array_equal(other0, _float_inputs(2, count, "float64"))
    np.testing.assert_array_equal(other1, _float_inputs(1, count, "float64"))
    assert (waited0, waited1) == (0, 1)
    assert after0 - waited0 + after1 - waited1 <= 1


@needs_native
def test_a_recv_unlike_its_send_on_the_core_is_a_mismatch(shm_directory):
    def body(rank):
        if rank == 0:
            col.send(np.ones(4, np.float32), 1, tag=2)
            return None
        with pytest.raises(col.CollectiveMismatchError) as caught:
            col.recv(np.ones(4, np.float64), 0, tag=2, timeout=5)
        return caught.value

    _, error = run_ranks(2, body, factory_of=_native_factory(2, shm_directory), timeout=30)
    assert error.differences.get("dtype") and error.ranks == (1, 0)


@needs_native
@pytest.mark.parametrize("sender_count, receiver_count", [(20_000, 8), (8, 20_000),
                                                          (20_000, 20_001)])
def test_a_send_and_recv_of_other_sizes_are_a_mismatch_on_either_side_of_the_cores_limit(
        shm_directory, sender_count, receiver_count):
    """160 KB are offered to be read in place, 64 B go through the ring: the recv meets the
    send's header in the ring either way. The send of 160 KB waits a moment for its reader,
    and so may learn of the mismatch too."""
    def body(rank):
        if rank == 0:
            try:
                col.send(np.ones(sender_count), 1, timeout=20)
            except col.CollectiveMismatchError as error:
                return error
            return None
        with pytest.raises(col.CollectiveMismatchError) as caught:
            col.recv(np.ones(receiver_count), 0, timeout=20)
        return caught.value

    on_sender, error = run_ranks(2, body, factory_of=_native_factory(2, shm_directory),
                                 timeout=30)
    assert error.differences["count"] == (receiver_count, sender_count)
    assert on_sender is None or on_sender.differences["count"] == (sender_count,
                                                                   receiver_count)


# ------------------------------------------------------------------ the ray backend


def _engine_of(rank, group):
    from ray_collective.group import current_registry
    return "native" if current_registry().get(group).membership.native else "python"


def _set_pure_python(rank, value):
    if value is None:
        os.environ.pop("RAY_COLLECTIVE_PURE_PYTHON", None)
    else:
        os.environ["RAY_COLLECTIVE_PURE_PYTHON"] = value


def _join(rank, world_size, group):
    col.init_collective_group(world_size, rank, backend="ray", group_name=group)


def _results(rank, world_size, group):
    return {name: array.tobytes() for name, array in
            _every_collective(rank, world_size, "float32", 1000, col.ReduceOp.SUM,
                              group).items()}


def _leave(rank, group):
    col.destroy_collective_group(group)


@needs_native
def test_ray_groups_agree_on_one_engine_and_both_give_the_same_bits(ray_session, members):
    actors = members[:3]
    results = {}
    try:
        for engine, settings in (("native", [None, None, None]),
                                 ("python", [None, "1", None])):
            group = f"engines-{engine}"
            for actor, value in zip(actors, settings):
                ray_session.get(actor.__ray_call__.remote(
                    lambda _s, v=value: _set_pure_python(0, v)))
            run_in(ray_session, actors, _join, 3, group)
            try:
                assert run_in(ray_session, actors, _engine_of, group) == [engine] * 3
                results[engine] = run_in(ray_session, actors, _results, 3, group)
            finally:
                run_in(ray_session, actors, _leave, group)
    finally:
        run_in(ray_session, actors, _set_pure_python, None)
    assert results["native"] == results["python"]


def test_a_malformed_pure_python_setting_is_refused_at_init(ray_session, members):
    actor = members[0]
    try:
        ray_session.get(actor.__ray_call__.remote(lambda _s: _set_pure_python(0, "maybe")))
        outcome = ray_session.get(actor.__ray_call__.remote(lambda _s: _join_error()))
        assert outcome[0] == "ArgumentValueError" and "RAY_COLLECTIVE_PURE_PYTHON" in outcome[1]
    finally:
        ray_session.get(actor.__ray_call__.remote(lambda _s: _set_pure_python(0, None)))


def _join_error():
    try:
        col.init_collective_group(1, 0, backend="ray", group_name="malformed-engine")
    except Exception as err:  # noqa: BLE001 - the test reads the error
        return type(err).__name__, str(err)
    col.destroy_collective_group("malformed-engine")
    return "ok", ""


def test_a_crowded_machine_gets_longer_slices_from_25_ranks_a_core():
    from ray_collective.engine.native_runner import SLICE_S, slice_s_for
    assert slice_s_for(0.5) == slice_s_for(25) == SLICE_S
    assert slice_s_for(200) == pytest.approx(0.4)  # 400 ranks on 2 cores

"""The public API over the in-process backend, real ranks in threads, numpy as the reference:
every dtype and op (every collective at every size is tests/test_contract.py); plus
asynchrony, timeouts, mismatches, bad input and group lifetime."""

import threading
import time

import numpy as np
import pytest

import ray_collective as col
from ray_collective.testing import RanksFailed, run_ranks
from support import extras
from support.helpers import numpy_reduce, rank_data

OPS = [col.ReduceOp.SUM, col.ReduceOp.PRODUCT, col.ReduceOp.MIN, col.ReduceOp.MAX,
       col.ReduceOp.AVG]
DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
          "float16", "float32", "float64", "complex64", "complex128"]


def _ops_for(dtype):
    ops = [op for op in OPS if not (dtype == "bool" and op is col.ReduceOp.AVG)]
    return ops


def _expect_equal(got, want, dtype):
    if np.dtype(dtype).kind in "fc":
        np.testing.assert_allclose(got, want, rtol=1e-2 if dtype == "float16" else 1e-6)
    else:
        np.testing.assert_array_equal(got, want)


# ------------------------------------------------------------------ every dtype and op

# Every collective at every size is the contract of tests/support/contract.py (tests/test_contract.py).

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("world_size", [3, 4])
def test_reductions_every_dtype_and_op(dtype, world_size):
    ops = _ops_for(dtype)
    shape = (2, 5)
    inputs = {op: [rank_data(r, shape, dtype, op) for r in range(world_size)] for op in ops}

    def body(rank):
        out = {}
        for op in ops:
            x = inputs[op][rank].copy()
            col.allreduce(x, op=op)
            y = inputs[op][rank].copy()
            col.reduce(y, dst_rank=world_size - 1, op=op)
            z = np.zeros(shape, dtype)
            col.reducescatter(z, [inputs[op][(rank + j) % world_size]
                                  for j in range(world_size)], op=op)
            out[op] = (x, y, z)
        return out

    results = run_ranks(world_size, body)
    for op in ops:
        want = numpy_reduce(inputs[op], op)
        for rank, out in enumerate(results):
            x, y, z = out[op]
            _expect_equal(x, want, dtype)
            _expect_equal(y, want if rank == world_size - 1 else inputs[op][rank], dtype)
            contributions = [inputs[op][(r + rank) % world_size] for r in range(world_size)]
            _expect_equal(z, numpy_reduce(contributions, op), dtype)


def test_avg_on_integers_truncates_toward_zero():
    values = [np.array([-7, 7, -1, 5], np.int32), np.array([0, 0, 0, 0], np.int32)]

    def body(rank):
        x = values[rank].copy()
        col.allreduce(x, op=col.ReduceOp.AVG)
        return x

    for x in run_ranks(2, body):
        np.testing.assert_array_equal(x, [-3, 3, 0, 2])


def test_avg_on_bool_is_refused_before_communication():
    def body(rank):
        with pytest.raises(TypeError, match="AVG"):
            col.allreduce(np.ones(3, bool), op=col.ReduceOp.AVG)
        return True

    assert run_ranks(2, body) == [True, True]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int64", "bool"])
def test_torch_tensors(dtype):
    torch = extras.need("torch", "torch tensors")
    torch_dtype = getattr(torch, dtype)
    inputs = [torch.arange(6, dtype=torch.float32).reshape(2, 3).mul(r + 1).to(torch_dtype)
              for r in range(3)]

    def body(rank):
        x = inputs[rank].clone()
        col.allreduce(x)
        listed = [torch.zeros(2, 3, dtype=torch_dtype) for _ in range(3)]
        col.allgather(listed, inputs[rank])
        return x, listed

    want = inputs[0].clone()
    for other in inputs[1:]:
        want = want + other if dtype != "bool" else want | other
    for x, listed in run_ranks(3, body):
        assert x.dtype == torch_dtype
        assert torch.equal(x, want)
        for i in range(3):
            assert torch.equal(listed[i], inputs[i])


# ------------------------------------------------------------------ extras

def test_async_op_returns_work_handles_completed_in_order():
    def body(rank):
        a, b = np.full(4, rank, np.int64), np.full(4, 10 * rank, np.int64)
        first = col.allreduce(a, async_op=True)
        second = col.allreduce(b, async_op=True)
        assert isinstance(first, col.Work)
        second.wait(timeout=30)
        first.wait()
        assert first.is_completed() and second.is_completed()
        c = np.ones(1)
        assert col.allreduce(c) is None
        return a, b, c

    for a, b, c in run_ranks(3, body):
        np.testing.assert_array_equal(a, [3] * 4)
        np.testing.assert_array_equal(b, [30] * 4)
        np.testing.assert_array_equal(c, [3.0])


def test_work_wait_timeout_raises_while_the_call_goes_on():
    release = threading.Event()

    def body(rank):
        x = np.ones(2)
        if rank == 0:
            work = col.allreduce(x, async_op=True)
            with pytest.raises(TimeoutError, match="still running"):
                work.wait(timeout=0.05)
            assert not work.is_completed()
            release.set()
            work.wait()
        else:
            release.wait(10)
            col.allreduce(x)
        return x

    for x in run_ranks(2, body):
        np.testing.assert_array_equal(x, [2.0, 2.0])


def test_work_wait_raises_the_calls_own_timeout_not_still_running():
    def body(rank):
        if rank == 1:
            return None
        work = col.allreduce(np.ones(2), async_op=True, timeout=0.2)
        with pytest.raises(col.CollectiveTimeoutError, match="waiting for ranks \\[1\\]"):
            work.wait(timeout=30)
        return "timed out"

    assert run_ranks(2, body, return_exceptions=True)[0] == "timed out"


@pytest.mark.parametrize("error", [
    col.PeerDiedError("g", 1, "allreduce", 3, [2], "its process exited"),
    col.CollectiveTimeoutError("g", 0, "barrier", 1, [2, 3], 1.5),
    col.CollectiveTimeoutError("g", 0, "barrier", 1, [2, 3], 1.5, reported_by=1),
    col.PostOfficeDiedError("g", 0, "allreduce", 4, "abcdef0123", [2, 3]),
    col.CollectiveMismatchError("g", 0, 1, "allreduce", 2, {"count": (1, 2)}),
    col.GroupBrokenError("g", 0, col.PeerDiedError("g", 1, "allreduce", 3, [2])),
    col.RankFailedError("g", 1, "ValueError", "bad"),
    col.GroupNotInitializedError("g"),
])
def test_errors_survive_pickling_as_ray_sends_them_to_the_driver(error):
    import pickle
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error) and str(copy) == str(error)
    assert vars(copy).keys() == vars(error).keys()
    if isinstance(error, col.GroupBrokenError):
        assert copy.cause.dead_ranks == (2,)


@pytest.mark.parametrize("error, expected", [
    (col.PeerDiedError("g", 1, "allreduce", 3, [2]), (col.PeerDiedError, "ranks [2] died")),
    (col.CollectiveTimeoutError("g", 1, "allreduce", 3, [2], 5.0),
     (col.CollectiveTimeoutError, "waiting for ranks [2] (reported by rank 1")),
    (col.PostOfficeDiedError("g", 1, "allreduce", 3, "abcdef0123", [2, 3]),
     (col.PostOfficeDiedError, "post office of node abcdef01 died")),
    (ValueError("odd"), (col.RankFailedError, "failed with ValueError: odd")),
])
def test_a_failure_reaches_the_other_ranks_as_their_own_error(error, expected):
    from ray_collective.errors import error_from_record, error_record
    import json
    rebuilt = error_from_record(json.loads(json.dumps(error_record("g", 1, error))), 0)
    kind, text = expected
    assert type(rebuilt) is kind and text in str(rebuilt)
    assert getattr(rebuilt, "rank", 0) == 0  # raised as this rank's own error


def test_send_recv_tags_match_in_order_per_tag():
    def body(rank):
        if rank == 0:
            col.send(np.array([1.0]), 1, tag=5)
            col.send(np.array([2.0]), 1, tag=9)
            col.send(np.array([3.0]), 1, tag=5)
            return None
        got = [np.zeros(1) for _ in range(3)]
        col.recv(got[0], 0, tag=9)
        col.recv(got[1], 0, tag=5)
        col.recv(got[2], 0, tag=5)
        return [float(g[0]) for g in got]

    assert run_ranks(2, body)[1] == [2.0, 1.0, 3.0]


def test_p2p_does_not_disturb_collective_sequence_of_other_ranks():
    """Also once the shapes are known (the second round and later take the known-shape path,
    which numbers a send or recv per channel)."""
    def body(rank):
        results = []
        for round_ in range(3):
            if rank == 0:
                col.send(np.full(2, round_ + 1.0), 2)
            elif rank == 2:
                got = np.zeros(2)
                col.recv(got, 0)
                results.append(got[0])
            x = np.full(2, rank + round_, np.int64)
            col.allreduce(x)
            results.append(x[0])
        return results

    outcome = run_ranks(3, body)
    for rank, results in enumerate(outcome):
        sums = [3 + 3 * round_ for round_ in range(3)]
        assert results == ([v for r in range(3) for v in (r + 1.0, sums[r])] if rank == 2
                           else sums)


def test_overlapping_groups_with_other_rank_orders_do_not_interfere():
    from ray_collective.backends.local import LocalBackendFactory
    from ray_collective.transport.local import LocalFabric

    reversed_group = LocalBackendFactory(LocalFabric(4, "reversed"))
    pair_group = LocalBackendFactory(LocalFabric(2, "pair"))

    def body(rank):
        col.init_collective_group(4, 3 - rank, reversed_group, "reversed")
        if rank < 2:
            col.init_collective_group(2, rank, pair_group, "pair")
        a, b, c = (np.full(2, rank + 1, np.int64) for _ in range(3))
        col.allreduce(a)
        col.allreduce(b, "reversed", op=col.ReduceOp.MAX)
        if rank < 2:
            col.allreduce(c, "pair")
        col.broadcast(a, src_rank=0, group_name="reversed")
        ranks = (col.get_rank(), col.get_rank("reversed"), col.get_rank("pair"))
        col.destroy_collective_group("reversed")
        if rank < 2:
            col.destroy_collective_group("pair")
        return a, b, c, ranks

    results = run_ranks(4, body)
    for rank, (a, b, c, ranks) in enumerate(results):
        # "reversed" rank 0 is thread 3, whose "default" allreduce gave 10 like everyone's.
        np.testing.assert_array_equal(a, [10, 10])
        np.testing.assert_array_equal(b, [4, 4])
        np.testing.assert_array_equal(c, [3, 3] if rank < 2 else [rank + 1] * 2)
        assert ranks == (rank, 3 - rank, rank if rank < 2 else -1)


def test_hierarchical_path_through_the_api():
    node_of = [0, 0, 1, 1, 1, 2]

    def body(rank):
        x = np.full(5, rank + 1, np.int64)
        col.allreduce(x)
        y = np.full(5, rank, np.int64) if rank == 3 else np.zeros(5, np.int64)
        col.broadcast(y, src_rank=3)
        z = np.full(5, rank + 1, np.int64)
        col.reduce(z, dst_rank=4)
        return x, y, z

    results = run_ranks(6, body, node_of=node_of)
    for rank, (x, y, z) in enumerate(results):
        np.testing.assert_array_equal(x, [21] * 5)
        np.testing.assert_array_equal(y, [3] * 5)
        np.testing.assert_array_equal(z, [21] * 5 if rank == 4 else [rank + 1] * 5)


def test_forced_algorithm_from_the_environment(monkeypatch):
    monkeypatch.setenv("RAY_COLLECTIVE_ALGORITHM", "allreduce=ring,broadcast=scatter_allgather")

    def body(rank):
        x = np.full(100, rank, np.float64)
        col.allreduce(x)
        y = np.arange(100.0) if rank == 0 else np.zeros(100)
        col.broadcast(y)
        return x, y

    for x, y in run_ranks(5, body):
        np.testing.assert_array_equal(x, np.full(100, 10.0))
        np.testing.assert_array_equal(y, np.arange(100.0))


# ------------------------------------------------------------------ failures

def test_rank_that_skips_the_call_gives_a_timeout_naming_it():
    def body(rank):
        if rank == 2:
            return None
        col.allreduce(np.ones(3), timeout=0.5)

    outcome = run_ranks(3, body, return_exceptions=True)
    errors = [e for e in outcome[:2]]
    assert any(isinstance(e, col.CollectiveTimeoutError) for e in errors)
    timeout = next(e for e in errors if isinstance(e, col.CollectiveTimeoutError))
    assert 2 in timeout.missing_ranks
    assert timeout.collective == "allreduce" and timeout.seq == 0
    assert "group 'default'" in str(timeout) and "#0" in str(timeout)
    for err in errors:
        assert isinstance(err, (col.CollectiveTimeoutError, col.GroupBrokenError))


def test_group_default_timeout_applies_and_broken_group_fails_fast():
    def body(rank):
        if rank == 0:
            with pytest.raises(col.CollectiveTimeoutError):
                col.recv(np.zeros(1), 1)
            with pytest.raises(col.GroupBrokenError, match="broken"):
                col.allreduce(np.ones(1))
        return True

    assert run_ranks(2, body, timeout=0.3) == [True, True]


@pytest.mark.parametrize("rank1_call, field", [
    (lambda: col.allreduce(np.ones(4, np.float32)), "dtype"),
    (lambda: col.allreduce(np.ones(5, np.float64)), "count"),
    (lambda: col.allreduce(np.ones(4, np.float64), op=col.ReduceOp.MAX), "op"),
    (lambda: col.broadcast(np.ones(4, np.float64), src_rank=0), "collective"),
])
def test_mismatched_calls_raise_mismatch_on_both_ranks(rank1_call, field):
    def body(rank):
        if rank == 0:
            col.allreduce(np.ones(4, np.float64), timeout=10)
        else:
            rank1_call()

    outcome = run_ranks(2, body, return_exceptions=True, timeout=10)
    for rank, err in enumerate(outcome):
        assert isinstance(err, col.CollectiveMismatchError), (rank, err)
        assert field in err.differences
        assert set(err.ranks) == {0, 1}
        assert f"rank {rank}" in str(err)


def test_different_roots_fail_every_rank_within_the_deadline():
    # Each rank waits on a tree parent that is not sending: a timeout, then the abort reaches
    # the others; never a hang or a silent result.
    def body(rank):
        col.reduce(np.ones(4), dst_rank=rank, timeout=0.5)

    started = time.monotonic()
    outcome = run_ranks(3, body, return_exceptions=True, timeout=0.5)
    assert time.monotonic() - started < 10
    assert all(isinstance(e, (col.CollectiveTimeoutError, col.GroupBrokenError)) for e in outcome)
    assert any(isinstance(e, col.CollectiveTimeoutError) for e in outcome)


def test_disagreement_no_receive_reveals_is_reported_all_the_same():
    # Each rank names itself the root, so both only send: no receive of the broadcast meets
    # the other's message. The inbox checks it as it arrives (same call number, another
    # header) or the next call's receive meets it: either way every rank raises a mismatch.
    def body(rank):
        col.broadcast(np.ones(4), src_rank=rank, timeout=10)
        col.barrier(timeout=10)

    outcome = run_ranks(2, body, return_exceptions=True, timeout=10)
    for err in outcome:
        assert isinstance(err, col.CollectiveMismatchError)
        assert (err.differences.get("root") in ((0, 1), (1, 0))
                or err.differences.get("collective") in (("barrier", "broadcast"),
                                                         ("broadcast", "barrier")))


def test_recv_of_a_different_shape_is_a_mismatch():
    def body(rank):
        if rank == 0:
            col.send(np.ones(3), 1, timeout=5)
        else:
            col.recv(np.ones(4), 0, timeout=5)

    outcome = run_ranks(2, body, return_exceptions=True, timeout=5)
    assert isinstance(outcome[1], col.CollectiveMismatchError)
    assert "count" in outcome[1].differences


# ------------------------------------------------------------------ bad input, before communication

BAD_CALLS = [
    (lambda: col.allreduce([1, 2, 3]), TypeError, "list"),
    (lambda: col.allreduce(np.float32(1)), TypeError, "scalar"),
    (lambda: col.allreduce(np.array(["a"])), TypeError, "dtype"),
    (lambda: col.allreduce(np.ones((4, 4))[:, 0]), ValueError, "contiguous"),
    (lambda: col.allreduce(np.ones(3), op="sum"), TypeError, "ReduceOp"),
    (lambda: col.allreduce(np.ones(3), timeout=0), ValueError, "timeout"),
    (lambda: col.allreduce(np.ones(3), timeout=-1), ValueError, "timeout"),
    (lambda: col.reduce(np.ones(3), dst_rank=2), ValueError, "dst_rank=2"),
    (lambda: col.broadcast(np.ones(3), src_rank=-1), ValueError, "src_rank=-1"),
    (lambda: col.broadcast(np.ones(3), src_rank=1.0), TypeError, "src_rank"),
    (lambda: col.allgather([np.ones(3)], np.ones(3)), ValueError, "world size|ranks"),
    (lambda: col.allgather([np.ones(3), np.ones(4)], np.ones(3)), ValueError, "shape"),
    (lambda: col.allgather([np.ones(3), np.ones(3, np.int32)], np.ones(3)), ValueError, "dtype"),
    (lambda: col.allgather(np.ones(3), np.ones(3)), TypeError, "list"),
    (lambda: col.reducescatter(np.ones(3), [np.ones(3)] * 3), ValueError, "3 tensors"),
    (lambda: col.alltoall([np.ones(2)] * 2, [np.ones(3)] * 2), ValueError, "shape"),
    (lambda: col.send(np.ones(3), 0), ValueError, "itself"),
    (lambda: col.recv(np.ones(3), 5), ValueError, "src_rank=5"),
    (lambda: col.send(np.ones(3), 1, tag=-1), ValueError, "tag"),
    (lambda: col.recv(np.ones(3), 1, tag="x"), ValueError, "tag"),
    (lambda: col.allreduce(np.asfortranarray(np.ones((3, 4)))), ValueError, "contiguous"),
    (lambda: col.allreduce(np.array([object()], dtype=object)), TypeError, "dtype"),
    (lambda: col.allreduce(np.ones(3), timeout=float("nan")), ValueError, "timeout"),
    (lambda: col.allreduce(np.ones(3), timeout=True), ValueError, "timeout"),
    (lambda: col.broadcast(np.ones(3), src_rank=True), TypeError, "src_rank"),
    (lambda: col.allreduce(np.ones(3), group_name=5), ValueError, "group_name"),
    (lambda: col.allreduce(np.ones(3), group_name=""), ValueError, "group_name"),
    (lambda: col.allreduce(np.ones(3), group_name="nope"), col.GroupNotInitializedError,
     "'nope' is not initialized"),
]


@pytest.mark.parametrize("call, error, message", BAD_CALLS)
def test_bad_input_raises_before_any_communication(call, error, message):
    def body(rank):
        if rank == 0:
            with pytest.raises(error, match=message):
                call()
            # Nothing was sent: the group still works and nothing is left in flight.
            x = np.ones(2)
            col.allreduce(x, timeout=10)
            return x
        x = np.ones(2)
        col.allreduce(x, timeout=10)
        return x

    for x in run_ranks(2, body):
        np.testing.assert_array_equal(x, [2.0, 2.0])


def test_read_only_output_is_written_through_and_strict_mode_refuses_it(monkeypatch):
    monkeypatch.delenv("RAY_COLLECTIVE_READ_ONLY", raising=False)

    def body(rank):
        frozen = np.full(3, rank + 1.0)
        frozen.setflags(write=False)
        col.allreduce(frozen)
        out = [np.zeros(3) for _ in range(2)]
        col.allgather(out, frozen)
        return frozen, out

    with pytest.warns(col.ReadOnlyTensorWarning):  # warnings filters are global: not per thread
        results = run_ranks(2, body)
    for frozen, out in results:
        np.testing.assert_array_equal(frozen, [3.0, 3.0, 3.0])
        np.testing.assert_array_equal(out[1], [3.0, 3.0, 3.0])

    monkeypatch.setenv("RAY_COLLECTIVE_READ_ONLY", "error")

    def strict(rank):
        frozen = np.ones(3)
        frozen.setflags(write=False)
        with pytest.raises(ValueError, match="read-only"):
            col.allreduce(frozen)
        out = [np.zeros(3) for _ in range(2)]
        col.allgather(out, frozen)  # nothing was sent: the group still works
        return out

    for out in run_ranks(2, strict):
        np.testing.assert_array_equal(out[1], np.ones(3))


def test_gpu_tensor_on_cpu_group_names_nccl():
    class FakeCupyArray:
        """Stands in for a cupy array (cupy is not installed on CPU machines)."""
        __module__ = "cupy"

    def body(rank):
        with pytest.raises(TypeError):
            col.allreduce(FakeCupyArray())
        return True

    assert all(run_ranks(1, body))


# ------------------------------------------------------------------ groups

def test_group_lifetime_and_queries():
    def body(rank):
        assert col.is_group_initialized("default")
        assert col.get_rank() == rank and col.get_collective_group_size() == 3
        assert col.get_rank("other") == -1 and col.get_collective_group_size("other") == -1
        assert not col.is_group_initialized("other")
        col.destroy_collective_group("other")  # as in ray.util.collective: a logged warning
        return True

    assert all(run_ranks(3, body))


def test_double_init_and_recreate_after_destroy():
    from ray_collective.backends.local import LocalBackendFactory
    from ray_collective.transport.local import LocalFabric

    with col.use_registry(col.GroupRegistry()):
        col.init_collective_group(1, 0, LocalBackendFactory(LocalFabric(1)), "g")
        with pytest.raises(col.GroupAlreadyInitializedError, match="already initialized"):
            col.init_collective_group(1, 0, LocalBackendFactory(LocalFabric(1)), "g")
        col.destroy_collective_group("g")
        assert not col.is_group_initialized("g")
        col.init_collective_group(1, 0, LocalBackendFactory(LocalFabric(1)), "g")
        x = np.ones(2)
        col.allreduce(x, "g")
        np.testing.assert_array_equal(x, [1.0, 1.0])
        col.destroy_collective_group("g")


def test_group_errors_are_caught_by_their_public_base_class():
    from ray_collective.backends.local import LocalBackendFactory
    from ray_collective.transport.local import LocalFabric

    with col.use_registry(col.GroupRegistry()):
        with pytest.raises(col.GroupError) as missing:
            col.allreduce(np.ones(2), group_name="never-made")
        assert type(missing.value) is col.GroupNotInitializedError
        col.init_collective_group(1, 0, LocalBackendFactory(LocalFabric(1)), "g")
        with pytest.raises(col.GroupError) as twice:
            col.init_collective_group(1, 0, LocalBackendFactory(LocalFabric(1)), "g")
        assert type(twice.value) is col.GroupAlreadyInitializedError
        col.destroy_collective_group("g")
    assert issubclass(col.GroupError, col.CollectiveError)


def test_gloo_timeout_in_milliseconds_sets_the_group_default():
    from ray_collective.backends.local import LocalBackendFactory
    from ray_collective.transport.local import LocalFabric

    with col.use_registry(col.GroupRegistry()):
        col.init_collective_group(2, 0, LocalBackendFactory(LocalFabric(2)), "g",
                                  gloo_timeout=200)
        started = time.monotonic()
        with pytest.raises(col.CollectiveTimeoutError, match="after 0.2s") as caught:
            col.barrier("g")
        assert time.monotonic() - started < 5
        assert caught.value.missing_ranks == (1,)
        col.destroy_collective_group("g")


@pytest.mark.parametrize("world_size, rank", [(0, 0), (-1, 0), (2, 2), (2, -1), (2.0, 0),
                                              (True, 0)])
def test_init_rejects_bad_world_size_and_rank(world_size, rank):
    with col.use_registry(col.GroupRegistry()):
        with pytest.raises(ValueError):
            col.init_collective_group(world_size, rank)


def test_ray_backend_outside_ray_says_to_call_ray_init(monkeypatch):
    pytest.importorskip("ray", reason="it stubs Ray's is_initialized")
    import ray
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with col.use_registry(col.GroupRegistry()):
        for backend in ("ray", "gloo", col.Backend.RAY):
            with pytest.raises(col.BackendNotAvailableError, match=r"ray\.init\(\)"):
                col.init_collective_group(2, 0, backend=backend, group_name="x")
            assert not col.is_group_initialized("x")
        with pytest.raises(ValueError, match="unknown backend"):
            col.init_collective_group(2, 0, backend="mpi")
        with pytest.raises(TypeError, match="backend"):
            col.init_collective_group(2, 0, backend=3)
    assert col.is_backend_available("ray") and col.gloo_available()
    assert not col.is_backend_available("mpi")  # as in ray.util.collective


@pytest.mark.parametrize("kwargs, message", [
    (dict(actors=[]), "non-empty"),
    (dict(actors=["a", "b"], world_size=3), "world_size=3"),
    (dict(actors=["a", "b"], ranks=[0, 0]), "permutation"),
    (dict(actors=["a", "b"], ranks=[1, 2]), "permutation"),
    (dict(actors=["a"], group_name=""), "group_name"),
])
def test_declare_collective_group_validates_before_anything(kwargs, message):
    with pytest.raises(ValueError, match=message):
        col.declare_collective_group(**kwargs)


def test_declare_collective_group_needs_actor_handles():
    assert col.create_collective_group is col.declare_collective_group
    with pytest.raises(TypeError, match="actor handle"):
        col.declare_collective_group(["a", "b"], world_size=2, ranks=[1, 0])


@pytest.mark.parametrize("call", [
    lambda: col.allreduce_multigpu([np.ones(2)]),
    lambda: col.reduce_multigpu([np.ones(2)]),
    lambda: col.broadcast_multigpu([np.ones(2)]),
    lambda: col.allgather_multigpu([[np.ones(2)]], [np.ones(2)]),
    lambda: col.reducescatter_multigpu([np.ones(2)], [[np.ones(2)]]),
    lambda: col.send_multigpu(np.ones(2), 1, 0),
    lambda: col.recv_multigpu(np.ones(2), 1, 0),
])
def test_multigpu_variants_need_the_nccl_backend(call):
    def body(rank):
        with pytest.raises(col.UnsupportedOperationError, match="nccl"):
            call()
        return True

    assert all(run_ranks(1, body))
    with col.use_registry(col.GroupRegistry()):
        with pytest.raises(col.GroupNotInitializedError):
            call()


def test_ray_util_collective_reduce_op_is_accepted_by_name():
    pytest.importorskip("ray", reason="it passes ray.util.collective's ReduceOp")
    import ray.util.collective.types as ray_types

    def body(rank):
        x = np.full(2, rank + 1.0)
        col.allreduce(x, op=ray_types.ReduceOp.MAX)
        return x

    for x in run_ranks(2, body):
        np.testing.assert_array_equal(x, [2.0, 2.0])


def test_run_ranks_reports_every_failed_rank():
    def body(rank):
        if rank == 1:
            raise KeyError("boom")
        return rank

    with pytest.raises(RanksFailed, match="rank 1: KeyError"):
        run_ranks(2, body)


@pytest.mark.parametrize("cause", [
    "rank 2 died.",
    "rank 2 died. Destroy the group and create it again.",
])
def test_a_broken_group_gives_its_advice_once(cause):
    message = str(col.GroupBrokenError("g", 1, RuntimeError(cause)))
    assert message.startswith("rank 1 of group 'g' is broken by an earlier failure: rank 2 died.")
    assert message.count("Destroy the group and create it again.") == 1

"""The contract of tests/support/contract.py bound to the backends whose ranks run as threads here: the
in-process backend (flat and with a pretend rank→node map), a backend registered from outside
the package under a name of its own, and the NCCL backend over its recording stand-in. The
``ray`` backend's binding is in tests/test_ray_backend.py (actors), real NCCL's in
tests/test_nccl_gpu.py. Also: registering backends, and what a backend that declares fewer
collectives gives."""

import threading

import numpy as np
import pytest

import ray_collective as col
from support.contract import CASES, check_every_collective, every_collective
from support.nccl_ranks import run_nccl_ranks, values_of
from support.nccl_standin import StandInGpus, StandInKind
from ray_collective.backends.base import BackendFactory
from ray_collective.engine.cpu import TransportMembership
from ray_collective.testing import run_ranks
from ray_collective.transport.local import LocalFabric
from ray_collective.types import Collective

WORLD_SIZES = [1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17]


class ThreadFabrics(BackendFactory):
    """A backend of the kind a third party writes: ranks of one process meeting by group name
    on an in-process fabric, built from the package's public pieces (the transport backend
    runs the algorithms; the local transport moves the data)."""

    name = "threads"

    def __init__(self, collectives=frozenset(Collective)):
        self.collectives = collectives
        self._joining = {}
        self._lock = threading.Lock()

    def available(self) -> bool:
        return True

    def create(self, group_name, world_size, rank, timeout):
        # The first rank of a group opens its fabric; the last one to join closes the door, so
        # that a later group of the same name gets a fabric of its own.
        with self._lock:
            fabric, joined = self._joining.pop(group_name, (None, 0))
            fabric = fabric or LocalFabric(world_size, group_name)
            if joined + 1 < world_size:
                self._joining[group_name] = (fabric, joined + 1)
        backend = TransportMembership(group_name, fabric.transport(rank))
        backend.collectives = self.collectives
        return backend


col.register_backend("contract-threads", ThreadFabrics())
col.register_backend("contract-no-alltoall",
                     ThreadFabrics(frozenset(Collective) - {Collective.ALLTOALL}))


GROUP = "contract"


def _local(world_size, body):
    return run_ranks(world_size, body, group_name=GROUP)


def _local_on_pretend_nodes(world_size, body):
    return run_ranks(world_size, body, group_name=GROUP,
                     node_of=[r // 2 for r in range(world_size)])


def _registered(world_size, body):
    return run_ranks(world_size, body, group_name=GROUP,
                     factory_of=lambda rank: "contract-threads")


BINDINGS = {"local": _local, "local-on-nodes": _local_on_pretend_nodes,
            "registered": _registered}


@pytest.mark.parametrize("binding", sorted(BINDINGS))
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_every_collective_matches_numpy(binding, world_size):
    for dtype, op_name, length in CASES:
        results = BINDINGS[binding](world_size, lambda rank: every_collective(
            rank, GROUP, world_size, dtype, op_name, length))
        check_every_collective(results, world_size, dtype, op_name, length)


@pytest.mark.parametrize("kind", ["dlpack", "memoryview"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 5, 8])
def test_every_collective_matches_numpy_on_arrays_known_only_by_their_protocol(kind, world_size):
    for dtype, op_name, length in CASES:
        results = _local(world_size, lambda rank: every_collective(
            rank, GROUP, world_size, dtype, op_name, length, kind))
        check_every_collective(results, world_size, dtype, op_name, length)


@pytest.mark.parametrize("world_size", [1, 3])
def test_every_collective_matches_numpy_on_the_nccl_stand_in(world_size):
    gpus = StandInGpus(device_count=world_size)
    kind = StandInKind(gpus)
    for dtype, op_name, length in CASES:
        results = values_of(run_nccl_ranks(
            gpus.library(), world_size, group_name=GROUP,
            body=lambda rank: every_collective(rank, GROUP, world_size, dtype, op_name, length,
                                               kind)))
        check_every_collective(results, world_size, dtype, op_name, length)


def test_a_collective_the_backend_does_not_declare_is_refused_before_anything_is_sent():
    def body(rank):
        with pytest.raises(col.UnsupportedOperationError, match="has no alltoall") as refused:
            col.alltoall([np.zeros(2)] * 2, [np.ones(2)] * 2, GROUP)
        x = np.full(3, rank + 1.0)
        col.allreduce(x, GROUP)
        return str(refused.value), x

    for message, x in run_ranks(2, body, group_name=GROUP,
                                factory_of=lambda rank: "contract-no-alltoall"):
        assert f"group '{GROUP}'" in message and "runs allgather" in message
        np.testing.assert_array_equal(x, [3.0, 3.0, 3.0])


def test_registered_names_are_case_insensitive_and_listed_when_a_name_is_unknown():
    results = run_ranks(2, lambda rank: col.get_rank(GROUP), group_name=GROUP,
                        factory_of=lambda rank: "Contract-THREADS")
    assert results == [0, 1]
    with pytest.raises(col.ArgumentValueError) as unknown:
        col.init_collective_group(1, 0, backend="no-such-backend", group_name="never")
    assert "contract-threads" in str(unknown.value) and "ray" in str(unknown.value)
    assert not col.is_group_initialized("never")


@pytest.mark.parametrize("name, factory, error, match", [
    ("ray", ThreadFabrics(), col.ArgumentValueError, "registered already"),
    ("contract-threads", ThreadFabrics(), col.ArgumentValueError, "registered already"),
    ("GLOO", ThreadFabrics(), col.ArgumentValueError, "it means 'ray'"),
    ("  ", ThreadFabrics(), col.ArgumentValueError, "cannot name a backend"),
    (7, ThreadFabrics(), col.ArgumentTypeError, "must be a str"),
    ("contract-not-a-factory", object(), col.ArgumentTypeError, "BackendFactory"),
])
def test_registering_a_backend_refuses_bad_names_and_factories(name, factory, error, match):
    with pytest.raises(error, match=match):
        col.register_backend(name, factory)
    assert col.is_backend_available("ray")

"""``shrink_collective_group`` and ``grow_collective_group`` without Ray: what they refuse before
anything is sent, the backends that cannot (NCCL says why), and a registered backend that
declares it can, through which the group layer's move to a new membership is checked (new rank
and size, numbering and known shapes started afresh, the broken state gone, the old membership
released)."""

import threading

import numpy as np

import ray_collective as col
from ray_collective.backends.base import BackendFactory, Reformed
from ray_collective.engine.cpu import TransportMembership
from ray_collective.testing import run_ranks
from ray_collective.transport.local import LocalFabric
from support.nccl_ranks import run_nccl_ranks
from support.nccl_standin import StandInGpus


def _outcome(call):
    try:
        return "ok", call()
    except Exception as err:  # noqa: BLE001 - the test reads what each rank got
        return type(err).__name__, str(err)


def test_what_cannot_work_is_refused_before_anything_is_sent():
    def body(rank):
        group = col.get_group_handle()
        numbered = [call["seq"] for call in group.trace()]
        outcomes = {
            "smaller": _outcome(lambda: col.grow_collective_group(world_size=2)),
            "no size": _outcome(lambda: col.grow_collective_group()),
            "actors in a member": _outcome(lambda: col.grow_collective_group(
                world_size=3, actors=[object()])),
            "bad size": _outcome(lambda: col.grow_collective_group(world_size=-1)),
            "bad timeout": _outcome(lambda: col.shrink_collective_group(timeout=0)),
            "bad name": _outcome(lambda: col.shrink_collective_group("")),
            "unknown group": _outcome(lambda: col.shrink_collective_group("nowhere")),
            "unknown group grown": _outcome(lambda: col.grow_collective_group(
                "nowhere", world_size=3)),
        }
        tensor = np.full(2, rank + 1.0)
        col.allreduce(tensor)  # the group is as it was
        return (outcomes, numbered == [] and [call["seq"] for call in group.trace()] == [0],
                tensor.tolist())

    for outcomes, untouched, total in run_ranks(2, body):
        assert untouched and total == [3.0, 3.0]
        kinds = {case: kind for case, (kind, _) in outcomes.items()}
        assert kinds == {"smaller": "ArgumentValueError", "no size": "ArgumentValueError",
                         "actors in a member": "ArgumentValueError",
                         "bad size": "ArgumentValueError", "bad timeout": "ArgumentValueError",
                         "bad name": "ArgumentValueError",
                         "unknown group": "GroupNotInitializedError",
                         "unknown group grown": "GroupNotInitializedError"}
        assert "has 2 ranks already" in outcomes["smaller"][1]


def test_a_backend_without_elastic_groups_refuses_and_the_group_stays_usable():
    def body(rank):
        shrink = _outcome(lambda: col.shrink_collective_group(timeout=5))
        grow = _outcome(lambda: col.grow_collective_group(world_size=3, timeout=5))
        tensor = np.full(2, rank + 1.0)
        col.allreduce(tensor)
        return shrink, grow, tensor.tolist()

    for shrink, grow, total in run_ranks(2, body):
        assert shrink[0] == grow[0] == "UnsupportedOperationError"
        assert "cannot shrink" in shrink[1] and "'ray' backend can shrink" in shrink[1]
        assert "cannot grow" in grow[1]
        assert total == [3.0, 3.0]


def test_the_nccl_backend_refuses_saying_cupy_has_no_shrink():
    gpus = StandInGpus(device_count=2)
    try:
        def body(rank):
            return (_outcome(lambda: col.shrink_collective_group(timeout=5)),
                    _outcome(lambda: col.grow_collective_group(world_size=3, timeout=5)),
                    col.is_group_initialized())

        for shrink, grow, initialized in run_nccl_ranks(gpus.library(), 2, body):
            assert initialized
            for (kind, message), what in ((shrink, "shrink"), (grow, "grow")):
                assert kind == "UnsupportedOperationError", message
                assert f"'nccl' backend cannot {what}" in message
                assert "ncclCommShrink" in message and "CuPy" in message
    finally:
        gpus.close()


class _Reforms:
    """What the ranks of the elastic stand-in backend share: the survivors each call's
    membership keeps, and one fabric per new membership."""

    def __init__(self, group_name):
        self.group_name = group_name
        self.lock = threading.Lock()
        self.fabrics = {}
        self.closed = []

    def fabric(self, kept):
        with self.lock:
            if kept not in self.fabrics:
                self.fabrics[kept] = LocalFabric(len(kept), self.group_name)
            return self.fabrics[kept]


class _ElasticMembership(TransportMembership):
    """The in-process backend's membership, able to shrink to the ranks that are not told
    to be gone (a backend of a program's own, declaring that it can)."""

    def __init__(self, transport, reforms, gone):
        super().__init__(reforms.group_name, transport)
        self.reforms, self.gone = reforms, gone

    def shrink(self, failures, timeout):
        kept = tuple(r for r in range(self.world_size) if r not in self.gone)
        rank = kept.index(self.rank)
        new = _ElasticMembership(self.reforms.fabric(kept).transport(rank), self.reforms, ())
        return Reformed(new, rank, len(kept), kept)

    def close(self):
        self.reforms.closed.append(self)
        super().close()


class _ElasticFactory(BackendFactory):
    """Joins the stand-in's ranks to one fabric; :meth:`start` prepares a run."""

    name = "elastic-stand-in"

    def start(self, world_size, gone):
        self.fabric = LocalFabric(world_size, "default")
        self.reforms = _Reforms("default")
        self.gone = gone

    def available(self):
        return True

    def create(self, group_name, world_size, rank, timeout):
        return _ElasticMembership(self.fabric.transport(rank), self.reforms, self.gone)


_ELASTIC = _ElasticFactory()
col.register_backend("elastic-stand-in", _ELASTIC)


def test_a_registered_backend_that_can_shrink_moves_the_group_to_its_new_membership():
    """All four ranks allreduce once (the group learns the call's shape); then rank 1 leaves,
    and the others' next call times out and breaks the group; they shrink, and a call of the
    same shape sums over the three, numbered from 0 again."""
    _ELASTIC.start(4, gone={1})

    def leaver(rank):
        col.allreduce(np.full(4, 1.0))

    def survivor(rank):
        group = col.get_group_handle()
        learnt = np.full(4, 1.0)
        col.allreduce(learnt)
        first = _outcome(lambda: col.allreduce(learnt, timeout=0.5))
        old = group.membership
        new_rank = col.shrink_collective_group(timeout=5)
        tensor = np.full(4, float(new_rank + 1))
        col.allreduce(tensor)
        col.allreduce(tensor, op=col.ReduceOp.MAX)
        numbered = [call["seq"] for call in group.trace()[-2:]]
        return (first[0], new_rank, col.get_collective_group_size(), tensor.tolist(),
                numbered, group.broken, old in _ELASTIC.reforms.closed,
                group.membership is not old)

    results = run_ranks(4, lambda rank: leaver(rank) if rank == 1 else survivor(rank),
                        factory_of=lambda rank: "elastic-stand-in", timeout=30)
    assert results[1] is None
    for rank, new_rank in ((0, 0), (2, 1), (3, 2)):
        first, got_rank, size, tensor, seq, broken, closed, moved = results[rank]
        assert first in ("CollectiveTimeoutError", "GroupBrokenError")
        assert (got_rank, size, tensor) == (new_rank, 3, [6.0] * 4)
        assert seq == [0, 1] and broken is None and closed and moved

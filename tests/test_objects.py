"""The object collectives (``ray_collective.objects``) against a reference: what each rank
must hold is the sender's objects after a pickle round trip (``pickle.loads(pickle.dumps(x))``),
checked on ranks that are threads of one process (``ray_collective.testing``), and once in
Ray actors on the ``ray`` backend."""

import pickle
from collections import OrderedDict
from fractions import Fraction

import numpy as np
import pytest

import ray_collective as col
from ray_collective.testing import run_ranks
from support.helpers import run_in

WORLD = 3


def _object_of(rank):
    """Objects of different types and sizes per rank (rank 2's is the largest, so every other
    one is padded)."""
    return [{"rank": rank, "name": f"r{rank}"},
            ("tuple", Fraction(rank, 7), OrderedDict(a=np.arange(1000, dtype=np.float32))),
            {"big": b"x" * 50_000, "array": np.arange(17)}][rank]


def _reference(obj):
    return pickle.loads(pickle.dumps(obj))


def _same(a, b):
    return pickle.dumps(a) == pickle.dumps(b)


def test_all_gather_object_gives_every_rank_every_object():
    def body(rank):
        got = [None] * WORLD
        col.all_gather_object(got, _object_of(rank))
        return got

    for got in run_ranks(WORLD, body):
        assert all(_same(got[r], _reference(_object_of(r))) for r in range(WORLD))


@pytest.mark.parametrize("src", [0, 2])
def test_broadcast_object_list_fills_every_rank_with_the_senders_objects(src):
    sent = [{"lr": 0.1}, "text", [1, 2, 3], np.ones((2, 2))]

    def body(rank):
        objects = list(sent) if rank == src else [None] * len(sent)
        col.broadcast_object_list(objects, src)
        return objects

    for objects in run_ranks(WORLD, body):
        assert _same(objects, _reference(sent))


def test_gather_object_fills_only_the_destination():
    def body(rank):
        got = [None] * WORLD if rank == 1 else None
        col.gather_object(_object_of(rank), got, dst=1)
        return got

    results = run_ranks(WORLD, body)
    assert results[0] is None and results[2] is None
    assert all(_same(results[1][r], _reference(_object_of(r))) for r in range(WORLD))


def test_scatter_object_list_gives_rank_i_object_i():
    def body(rank):
        out = [None]
        col.scatter_object_list(out, [_object_of(r) for r in range(WORLD)] if rank == 0
                                else None, src=0)
        return out[0]

    for rank, got in enumerate(run_ranks(WORLD, body)):
        assert _same(got, _reference(_object_of(rank)))


def test_bad_lists_and_unpicklable_objects_are_refused_before_anything_is_sent():
    def body(rank):
        if rank == 0:
            with pytest.raises(col.ArgumentValueError, match="one per rank"):
                col.all_gather_object([None], "x")
            with pytest.raises(col.ArgumentTypeError, match="cannot be pickled"):
                col.all_gather_object([None] * WORLD, lambda: None)
            with pytest.raises(col.ArgumentTypeError, match="must be a list"):
                col.scatter_object_list((None,), None, src=1)
        col.barrier()   # nothing of the refused calls reached the others
        got = [None] * WORLD
        col.all_gather_object(got, rank)
        return got

    assert run_ranks(WORLD, body) == [list(range(WORLD))] * WORLD


def _objects_in_actor(rank, group):
    col.init_collective_group(2, rank, backend="ray", group_name=group, timeout=60)
    try:
        got = [None, None]
        col.all_gather_object(got, {"rank": rank, "payload": "y" * (rank * 10_000)}, group)
        broadcast = [None] if rank else [("from", 0)]
        col.broadcast_object_list(broadcast, 0, group)
        return got, broadcast
    finally:
        col.destroy_collective_group(group)


def test_object_collectives_in_ray_actors(ray_session, members):
    results = run_in(ray_session, members[:2], _objects_in_actor, "objects")
    expected = [{"rank": r, "payload": "y" * (r * 10_000)} for r in range(2)]
    assert results == [(expected, [("from", 0)])] * 2

"""Weight sync on the ``nccl`` backend, against the NCCL stand-in (no GPU): every member a thread
with a stand-in GPU of its own, its tensors stand-in CuPy arrays, the same calls as on ``ray``.

They check the GPU path's own logic: the subscribers' tensors equal the publishers' bit for bit
after each version (replicas and shards, several dtypes, buckets fused by device copies and
buckets moved in place), the bytes never staged through host memory, unchanged buckets
skipped, bad input refused on every member before any of the model's bytes is broadcast, and a
member that never comes ending in the caller's timeout. They say nothing about real NCCL, CuPy
or a GPU (nothing here has run on one).
"""

import time

import numpy as np
import pytest

import ray_collective as col
from ray_collective.backends.nccl import InProcessRendezvous, NcclBackendFactory
from ray_collective.errors import (UnsupportedOperationError, WeightSyncError,
                                   WeightSyncMismatchError)
from support.nccl_standin import StandInGpus
from support.nccl_standin_cupy import DEVICE_TO_HOST, HOST_TO_DEVICE, races, standin_cupy
from support.weight_sync import run_members

BUCKET = 1024
SIZES = {"embed": (64, 33), "layer.0.w": (300,), "layer.0.b": (5,), "layer.1.w": (17, 19),
         "head": (1,)}
DTYPES = ["float32", "float16", "float64", "int8", "int64", "uint8", "complex64", "bool"]


def values(seed, sizes=SIZES, dtype="float32"):
    rng = np.random.default_rng(seed)
    return {name: (rng.standard_normal(shape) * 50).astype(dtype)
            for name, shape in sizes.items()}


class World:
    """Stand-in GPUs (member k on device k: publishers first), one rendezvous, and each
    member's stand-in CuPy arrays."""

    def __init__(self, publishers, subscribers, name="w"):
        self.P, self.S, self.name = publishers, subscribers, name
        self.gpus = StandInGpus(device_count=publishers + subscribers)
        self.library = self.gpus.library()
        self.cupy = standin_cupy(self.gpus)
        self.rendezvous = InProcessRendezvous()
        self.kept = []          # every array made: an address names one allocation (races)

    def factory(self, device):
        return NcclBackendFactory(rendezvous=self.rendezvous, devices=[device],
                                  library=self.library)

    def device(self, role, index):
        return index if role == "publisher" else self.P + index

    def arrays(self, state, device):
        arrays = {k: self.gpus.array(v, device=device) for k, v in state.items()}
        self.kept.append(arrays)
        return arrays

    def host(self, arrays):
        return {k: self.gpus.host(v) for k, v in arrays.items()}

    def join(self, role, index, timeout=20):
        device = self.device(role, index)
        self.gpus.cuda.runtime.setDevice(device)       # as a process with one GPU has it
        col.init_weight_sync(self.name, role, index, self.P, self.S,
                             backend=self.factory(device), timeout=timeout,
                             bucket_bytes=BUCKET, cupy=self.cupy)

    def run(self, bodies):
        try:
            return run_members(bodies, timeout=60)
        finally:
            self.gpus.close()

    def on_caller_stream(self, destination, source):
        """A device copy on the calling thread's current stream (a training step writing the
        weights, an inference reading them): weight sync must order itself with it."""
        device = destination.device.id
        stream = self.gpus.cuda.get_current_stream(device).ptr
        self.gpus.cuda.runtime.memcpyAsync(destination.data.ptr, source.data.ptr,
                                           source.host.nbytes, 3, stream)

    def read(self, arrays):
        """What a kernel on the caller's stream reads from ``arrays`` now: copied there on the
        caller's stream, then waited for."""
        copies = self.arrays({k: np.zeros_like(v.host) for k, v in arrays.items()},
                             next(iter(arrays.values())).device.id)
        for k, v in arrays.items():
            self.on_caller_stream(copies[k], v)
        self.gpus.cuda.runtime.deviceSynchronize()
        return self.host(copies)

    def broadcasts(self):
        return self.gpus.calls("broadcast")

    def host_copies(self):
        return [c for c in self.gpus.calls("memcpyAsync")
                if len(c) > 6 and c[6] in (HOST_TO_DEVICE, DEVICE_TO_HOST)]


def sync_versions(world, publisher_states, subscriber_states, versions, step=None,
                  publish_kwargs=None):
    """Each member's list of results over ``len(versions)`` syncs; every tensor stays a stand-in
    array of its member's GPU, ``step(k, state)`` changes the publishers' host values."""
    def publisher(i):
        def body():
            world.join("publisher", i)
            out, device = [], world.device("publisher", i)
            arrays = world.arrays(publisher_states[i], device)
            for k, version in enumerate(versions):
                if step:
                    step(k, publisher_states[i])
                for name, new in world.arrays(publisher_states[i], device).items():
                    world.on_caller_stream(arrays[name], new)        # the training step
                extra = publish_kwargs(k) if publish_kwargs else {}
                out.append(col.publish_weights(arrays, world.name, version=version, **extra))
                out.append(col.weight_sync_report(world.name))
            col.destroy_weight_sync(world.name)
            return out
        return body

    def subscriber(j):
        def body():
            world.join("subscriber", j)
            arrays = world.arrays(subscriber_states[j], world.device("subscriber", j))
            out = []
            for _ in versions:
                out.append(col.receive_weights(arrays, world.name))
                out.append(world.read(arrays))                    # the inference
            col.destroy_weight_sync(world.name)
            return out
        return body

    results = world.run([publisher(i) for i in range(world.P)]
                        + [subscriber(j) for j in range(world.S)])
    for result in results:
        assert not isinstance(result, BaseException), result
    assert races(world.gpus) == []
    return results


def assert_bits(got, want):
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key].dtype == want[key].dtype and got[key].shape == want[key].shape
        assert got[key].tobytes() == want[key].tobytes(), key


def add_one(k, state):
    for key in state:
        state[key] = (state[key] + np.asarray(1, state[key].dtype)).astype(state[key].dtype)


@pytest.mark.parametrize("publishers", [1, 2])
def test_replicas_arrive_bit_for_bit_through_device_copies_only(publishers):
    world = World(publishers, 3)
    base = values(0)
    pubs = [{k: v.copy() for k, v in base.items()} for _ in range(publishers)]
    subs = [values(10 + j) for j in range(3)]
    results = sync_versions(world, pubs, subs, [0, 5], step=add_one)
    for j in range(3):
        member = results[publishers + j]
        assert member[0::2] == [0, 5]
        assert_bits(member[-1], pubs[0])
    model_bytes = sum(v.nbytes for v in base.values())
    # Every model byte left a publisher (rank 0 of its data group) in a broadcast of bytes,
    # fused or in place, once per version (besides each sync's few flag bytes); what crossed
    # between host and GPU is only control words, each smaller than one bucket.
    sent = sum(c[4]["count"] for c in world.broadcasts() if c[2] == 0)
    assert 2 * model_bytes <= sent <= 2 * model_bytes + 64
    assert world.host_copies() and max(c[4] for c in world.host_copies()) < BUCKET


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_arrives_bit_for_bit(dtype):
    world = World(1, 2)
    pub = values(3, dtype=dtype)
    subs = [values(30 + j, dtype=dtype) for j in range(2)]
    results = sync_versions(world, [pub], subs, [1])
    for member in results[1:]:
        assert member[0] == 1
        assert_bits(member[1], pub)


def test_shards_deliver_the_union():
    world = World(2, 2)
    full = values(4)
    names = sorted(full)
    shards = [{k: full[k] for k in names[0::2]}, {k: full[k] for k in names[1::2]}]
    subs = [values(40 + j) for j in range(2)]
    results = sync_versions(world, shards, subs, [2])
    for member in results[2:]:
        assert_bits(member[1], full)


def test_unchanged_tensors_are_not_sent_and_the_rest_arrive():
    world = World(1, 2)
    pub = values(5)
    subs = [values(50 + j) for j in range(2)]

    def step(k, state):
        if k == 1:
            state["embed"] = state["embed"] + np.float32(1)

    others = [k for k in SIZES if k != "embed"]
    results = sync_versions(world, [pub], subs, [0, 1], step=step,
                            publish_kwargs=lambda k: {"unchanged": others} if k else {})
    first, second = results[0][1], results[0][3]
    assert first.full and first.moved_bytes == first.model_bytes
    assert not second.full and second.moved_bytes == pub["embed"].nbytes
    for member in results[1:]:
        assert_bits(member[-1], pub)


def _refused_everywhere(world, publisher_arrays, subscriber_arrays, publish_kwargs=None):
    """One sync that every member must refuse: each member's error text, and whether any
    broadcast had been launched by then."""
    def publisher():
        world.join("publisher", 0)
        with pytest.raises(WeightSyncMismatchError) as err:
            col.publish_weights(publisher_arrays(), world.name, version=0,
                                **(publish_kwargs or {}))
        return str(err.value)

    def subscriber(j):
        def body():
            world.join("subscriber", j)
            with pytest.raises(WeightSyncMismatchError) as err:
                col.receive_weights(subscriber_arrays(j), world.name)
            return str(err.value)
        return body

    results = world.run([publisher] + [subscriber(j) for j in range(world.S)])
    for result in results:
        assert not isinstance(result, BaseException), result
    return results


@pytest.mark.parametrize("bad, message", [
    ("cpu", "subscriber 1: receive_weights: state_dict['head'] is a numpy tensor on the CPU; "
            "this weight sync runs on the 'nccl' backend"),
    ("all on the cpu", "subscriber 1: receive_weights: state_dict['embed'] is a numpy tensor "
                       "on the CPU"),
    ("shape", "tensor 'layer.0.w' is float32[300] in publisher 0 but float32[301] in "
              "subscriber 1"),
    ("digest", "publisher 0: publish_weights: digest=True: the 'nccl' backend keeps no change "
               "digest"),
    ("devices", "subscriber 1: receive_weights: state_dict['head'] is a cupy tensor on cuda:0 "
                "but state_dict['embed'] a cupy tensor on cuda:2"),
])
def test_bad_input_is_refused_on_every_member_before_any_broadcast(bad, message):
    world = World(1, 2)
    pub = values(6)

    def subscriber_arrays(j):
        state = values(60 + j, {**SIZES, "layer.0.w": (301,)} if bad == "shape" and j else
                       SIZES)
        arrays = world.arrays(state, world.device("subscriber", j))
        if j and bad == "cpu":
            arrays["head"] = state["head"]
        if j and bad == "all on the cpu":
            return state
        if j and bad == "devices":
            arrays["head"] = world.gpus.array(state["head"], device=0)
        return arrays

    texts = _refused_everywhere(world, lambda: world.arrays(pub, 0), subscriber_arrays,
                                {"digest": True} if bad == "digest" else None)
    for text in texts:
        assert message in text
    assert world.broadcasts() == []            # only the agreement's allgathers ran
    assert world.gpus.calls("allGather")


def test_gpu_tensors_on_the_ray_backend_are_refused_naming_the_tensor():
    from support.weight_sync import FabricPerGroup
    gpus = StandInGpus(device_count=1)
    fabric = FabricPerGroup()

    def publisher():
        col.init_weight_sync("w", "publisher", 0, 1, 1, backend=fabric, timeout=20)
        with pytest.raises(WeightSyncMismatchError) as err:
            col.publish_weights({"w": gpus.array(np.ones(3, np.float32))}, "w", version=0)
        return str(err.value)

    def subscriber():
        col.init_weight_sync("w", "subscriber", 0, 1, 1, backend=fabric, timeout=20)
        with pytest.raises(WeightSyncMismatchError) as err:
            col.receive_weights({"w": np.zeros(3, np.float32)}, "w")
        return str(err.value)

    for text in run_members([publisher, subscriber]):
        assert "state_dict['w'] is a cupy tensor on cuda:0; this weight sync runs on the " \
               "'ray' backend" in text


def test_a_member_that_never_comes_ends_in_the_callers_timeout_then_the_sync_is_broken():
    world = World(1, 2)
    pub, sub = values(7), values(70)
    came = []

    def publisher():
        world.join("publisher", 0)
        start = time.monotonic()
        with pytest.raises(WeightSyncError) as err:
            col.publish_weights(world.arrays(pub, 0), world.name, version=0, timeout=0.5)
        came.append(time.monotonic() - start)
        with pytest.raises(WeightSyncError) as again:
            col.publish_weights(world.arrays(pub, 0), world.name, version=1)
        return str(err.value), str(again.value)

    def subscriber(j):
        def body():
            world.join("subscriber", j)
            if j == 0:
                with pytest.raises(WeightSyncError) as err:
                    col.receive_weights(world.arrays(sub, world.device("subscriber", j)),
                                        world.name, timeout=0.5)
                return str(err.value), ""
            return "never came", ""          # subscriber 1 never calls receive_weights
        return body

    results = world.run([publisher, subscriber(0), subscriber(1)])
    for result in results[:2]:
        assert not isinstance(result, BaseException), result
        assert "did not complete" in result[0] or "timed out" in result[0], result[0]
        assert "destroy the weight sync and declare it again" in result[0]
    assert "destroy the weight sync and declare it again" in results[0][1]
    assert came and came[0] < 10


def test_async_syncs_order_with_the_stream_current_where_the_call_was_made():
    world = World(1, 1)
    pub, sub = values(8), values(80)

    def publisher():
        world.join("publisher", 0)
        world.gpus.use_stream(0, world.gpus.new_stream(0))      # the trainer's own stream
        arrays = world.arrays(values(0), 0)
        for name, new in world.arrays(pub, 0).items():
            world.on_caller_stream(arrays[name], new)             # the step, still queued
        work = col.publish_weights(arrays, world.name, version=3, async_op=True)
        version = work.wait(30)
        col.destroy_weight_sync(world.name)
        return version

    def subscriber():
        world.join("subscriber", 0)
        world.gpus.use_stream(1, world.gpus.new_stream(1))
        arrays = world.arrays(sub, 1)
        version = col.receive_weights(arrays, world.name, async_op=True).wait(30)
        got = world.read(arrays)
        col.destroy_weight_sync(world.name)
        return version, got

    first, (version, got) = world.run([publisher, subscriber])
    assert first == version == 3
    assert_bits(got, pub)
    assert races(world.gpus) == []


def test_subscribers_cannot_be_added_or_removed_on_nccl_and_the_driver_says_so():
    from ray_collective.group import current_registry
    from ray_collective.weight_sync.driver import DeclaredWeightSync

    class Handle:
        __ray_call__ = None

    registry = current_registry()
    registry.declared_weight_syncs["g"] = DeclaredWeightSync("g", [Handle()], {0: Handle()},
                                                             "nccl", 10.0, 0, 1)
    try:
        for call in (col.add_weight_subscribers, col.remove_weight_subscribers):
            with pytest.raises(UnsupportedOperationError, match="cannot shrink or grow"):
                call("g", [Handle()])
    finally:
        del registry.declared_weight_syncs["g"]


def test_large_tensors_move_from_and_into_their_own_memory():
    world = World(1, 1)
    pub, sub = values(9), values(90)
    tensors = {}

    def publisher():
        world.join("publisher", 0)
        arrays = tensors["publisher"] = world.arrays(pub, 0)
        col.publish_weights(arrays, world.name, version=0)
        col.destroy_weight_sync(world.name)

    def subscriber():
        world.join("subscriber", 0)
        arrays = tensors["subscriber"] = world.arrays(sub, 1)
        col.receive_weights(arrays, world.name)
        col.destroy_weight_sync(world.name)
        return world.host(arrays)

    _, got = world.run([publisher, subscriber])
    assert_bits(got, pub)
    embed = pub["embed"].nbytes                       # 8448 bytes: 9 pieces of a bucket
    for rank, role, buffer in ((0, "publisher", "sendbuf"), (1, "subscriber", "recvbuf")):
        start = tensors[role]["embed"].data.ptr
        pieces = [c[4][buffer] - start for c in world.broadcasts()
                  if c[2] == rank and start <= c[4][buffer] < start + embed]
        assert pieces == list(range(0, embed, BUCKET))


def test_the_race_check_finds_an_unordered_pair_and_accepts_an_event_wait():
    gpus = StandInGpus(device_count=1)
    cupy = standin_cupy(gpus)
    runtime = cupy.cuda.runtime
    a, b = gpus.array(np.arange(8, dtype=np.uint8)), gpus.array(np.zeros(8, np.uint8))
    first, second = gpus.new_stream(0), gpus.new_stream(0)
    runtime.memcpyAsync(b.data.ptr, a.data.ptr, 8, 3, first)
    runtime.memcpyAsync(a.data.ptr, b.data.ptr, 8, 3, second)       # b read, a written: racing
    assert len(races(gpus)) == 2
    event = runtime.eventCreateWithFlags(0)
    runtime.eventRecord(event, first)
    runtime.streamWaitEvent(second, event, 0)
    runtime.memcpyAsync(a.data.ptr, b.data.ptr, 8, 3, second)       # ordered by the event
    assert len(races(gpus)) == 2
    gpus.close()

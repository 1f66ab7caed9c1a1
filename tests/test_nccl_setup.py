"""Setting up NCCL groups without a GPU: the unique-id rendezvous (in-process and through a
stand-in for Ray's key-value store), the dtype and op mapping, the CuPy adapter's conversions,
and how the library behaves in this process, which has no CuPy."""

import importlib.util
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import ray_collective as col
from support.nccl_ranks import run_nccl_ranks, values_of
from support.nccl_standin import NCCL_CONSTANTS, StandInGpus
from ray_collective.backends.nccl import (InProcessRendezvous, NcclBackendFactory,
                                          RayRendezvous, synchronize_device)
from ray_collective.backends.nccl import library as library_module
from ray_collective.backends.nccl.library import NcclLibrary, takes_id_as_bytes
from ray_collective.backends.nccl.bootstrap import CliqueJoin
from ray_collective.backends.nccl.wire import format_version, movement_format, reduction_format

C = NCCL_CONSTANTS


# ------------------------------------------------------------------ rendezvous

def test_in_process_rendezvous_waits_publishes_and_forgets():
    rendezvous = InProcessRendezvous()
    assert rendezvous.fetch("k", 0) is None
    threading.Timer(0.05, rendezvous.publish, ("k", b"v")).start()
    assert rendezvous.fetch("k", 5) == b"v"
    rendezvous.delete("k")
    rendezvous.delete("k")
    started = time.monotonic()
    assert rendezvous.fetch("k", 0.1) is None
    assert 0.09 < time.monotonic() - started < 2


class StandInKeyValueStore:
    """Stands for ``ray.experimental.internal_kv``: records namespaces and keys."""

    def __init__(self, initialized=True):
        self.initialized = initialized
        self.values = {}
        self.namespaces = set()
        self.lock = threading.Lock()

    def _internal_kv_initialized(self):
        return self.initialized

    def _internal_kv_put(self, key, value, overwrite=True, *, namespace=None):
        assert isinstance(key, bytes) and isinstance(value, bytes) and overwrite
        with self.lock:
            self.namespaces.add(namespace)
            self.values[key] = value

    def _internal_kv_get(self, key, *, namespace=None):
        with self.lock:
            self.namespaces.add(namespace)
            return self.values.get(key)

    def _internal_kv_del(self, key, del_by_prefix=False, *, namespace=None):
        with self.lock:
            self.namespaces.add(namespace)
            for k in [k for k in self.values if k.startswith(key)] if del_by_prefix else [key]:
                self.values.pop(k, None)

    def _internal_kv_list(self, prefix, *, namespace=None):
        with self.lock:
            self.namespaces.add(namespace)
            return [k for k in self.values if k.startswith(prefix)]


def test_ray_rendezvous_scopes_keys_by_job_in_the_library_namespace():
    store = StandInKeyValueStore()
    rendezvous = RayRendezvous(job_id="02000000", store=store)
    threading.Timer(0.05, rendezvous.publish, ("g/world/reply", b"x")).start()
    assert rendezvous.fetch("g/world/reply", 5) == b"x"
    assert list(store.values) == [b"nccl/02000000/g/world/reply"]
    assert RayRendezvous(job_id="03000000", store=store).fetch("g/world/reply", 0) is None
    rendezvous.delete("g/world/reply")
    assert store.values == {} and store.namespaces == {"ray_collective"}


def test_ray_rendezvous_needs_ray_initialized():
    with pytest.raises(col.BackendNotAvailableError, match=r"ray.init\(\).*InProcessRendezvous"):
        RayRendezvous(job_id="01000000", store=StandInKeyValueStore(initialized=False))


def test_group_init_through_rays_store_leaves_no_key_behind():
    store = StandInKeyValueStore()
    gpus = StandInGpus(device_count=3)

    def body(rank):
        tensor = gpus.array(np.full(2, rank, np.int32), device=rank)
        col.allreduce(tensor)
        return tensor.host.copy()

    rendezvous = RayRendezvous(job_id="01000000", store=store, node="node")
    for got in values_of(run_nccl_ranks(gpus.library(), 3, body, rendezvous=rendezvous)):
        np.testing.assert_array_equal(got, [3, 3])
    assert store.values == {}
    assert len(gpus.calls("get_unique_id")) == 1
    assert gpus.calls("get_unique_id")[0][0].startswith("rank-0")


def _join(rendezvous, library, rank, world_size=2, timeout=5.0, devices=None):
    return CliqueJoin(rendezvous, library, "g", "world", world_size, rank,
                      devices or [rank], "init", 0, timeout)


def test_a_stale_reply_of_an_earlier_attempt_is_ignored():
    gpus = StandInGpus(device_count=2)
    library = gpus.library()
    rendezvous = InProcessRendezvous()
    rendezvous.publish("g/world/reply",
                       b'{"error": "an old failure", "nonces": {"1": "not-yours"}}')
    results = {}

    def rank1():
        results[1] = _join(rendezvous, library, 1).run()

    thread = threading.Thread(target=rank1, name="rank-1")
    thread.start()
    time.sleep(0.05)  # rank 1 has seen the stale reply and goes on waiting
    results[0] = _join(rendezvous, library, 0).run()
    thread.join(5)
    assert {results[0][0].uid} == {results[1][0].uid}
    assert rendezvous.keys() == ()


def test_a_record_that_is_not_ours_is_reported():
    gpus = StandInGpus(device_count=2)
    rendezvous = InProcessRendezvous()
    rendezvous.publish("g/world/rank/1", b"\x80 not json")
    with pytest.raises(col.CollectiveError, match="another program.*group_name"):
        _join(rendezvous, gpus.library(), 0).run()


def test_communicator_creation_that_fails_is_a_collective_error():
    gpus = StandInGpus(device_count=1)
    library = gpus.library()
    with pytest.raises(col.CollectiveError, match=r"could not create.*cuda:0.*ValueError"):
        library_calls = CliqueJoin(InProcessRendezvous(), library, "g", "world", 1, 0, [0],
                                   "init", 0, 5.0)
        library.unique_id = lambda: b"short"
        library_calls.run()


def test_unique_id_travels_as_bytes_and_returns_as_the_platforms_chars(monkeypatch):
    signed = StandInGpus(device_count=1, char_signed=True)
    unique_id = signed.library().unique_id()
    assert isinstance(unique_id, bytes) and len(unique_id) == 128
    # The stand-in communicator asserts the id's values fit the platform's char.
    signed.library().open_communicators(bytes(range(128, 256)), 1, [(0, 0)])
    monkeypatch.setattr(library_module, "_char_is_signed", lambda: False)
    unsigned = StandInGpus(device_count=1, char_signed=False)
    unsigned.library().open_communicators(bytes(range(128, 256)), 1, [(0, 0)])
    with pytest.raises(ValueError, match="128 bytes"):
        unsigned.library().open_communicators(b"x", 1, [(0, 0)])


def test_cupy_14_and_later_take_the_unique_id_as_bytes():
    assert [takes_id_as_bytes(v) for v in ("13.6.0", "14.0.0rc1", "14.2.0", "15.0.0a1", "dev")] \
        == [False, True, True, True, False]
    gpus = StandInGpus(device_count=1, id_as_bytes=True)
    unique_id = gpus.library().unique_id()
    assert isinstance(unique_id, bytes) and len(unique_id) == 128
    [communicator] = gpus.library().open_communicators(unique_id, 1, [(0, 0)])
    assert communicator.uid == tuple(unique_id)
    # The form a CuPy before 14 takes is refused by CuPy 14, as it refused it on a real GPU.
    with pytest.raises(TypeError, match="expected bytes"):
        NcclLibrary(gpus.cuda, gpus.nccl, id_as_bytes=False).open_communicators(
            unique_id, 1, [(0, 0)])


def test_several_gpus_of_one_process_join_inside_one_nccl_group():
    gpus = StandInGpus(device_count=3)
    communicators = gpus.library().open_communicators(bytes(128), 3, [(0, 0), (1, 1), (2, 2)])
    assert [c.device for c in communicators] == [0, 1, 2]
    names = [entry[1] for entry in gpus.log]
    assert names[0] == "groupStart" and names[-1] == "groupEnd"


# ------------------------------------------------------------------ factory and availability

def test_factory_checks_its_devices():
    gpus = StandInGpus(device_count=2)
    for devices in ([], [0, 0], [2], [True]):
        factory = NcclBackendFactory(devices=devices, library=gpus.library())
        with pytest.raises(ValueError, match="distinct GPU indices"):
            factory.create("g", 1, 0, 1.0)
    no_gpu = NcclBackendFactory(library=StandInGpus(device_count=0).library())
    with pytest.raises(col.BackendNotAvailableError, match="num_gpus"):
        no_gpu.create("g", 1, 0, 1.0)


def test_world_size_one_needs_no_ray_and_defaults_to_every_visible_gpu():
    gpus = StandInGpus(device_count=2)
    with col.use_registry(col.GroupRegistry()):
        col.init_collective_group(1, 0, NcclBackendFactory(library=gpus.library()), "solo")
        tensors = [gpus.array(np.full(2, d + 1.0), device=d) for d in (0, 1)]
        col.allreduce_multigpu(tensors, group_name="solo")
        col.destroy_collective_group("solo")
    for tensor in tensors:
        np.testing.assert_array_equal(tensor.host, [3.0, 3.0])


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None,
                    reason="CuPy is installed here; the test needs a process without it")
def test_without_cupy_the_backend_says_what_to_install():
    assert not col.nccl_available()
    assert not NcclBackendFactory().available()
    assert NcclBackendFactory(library=StandInGpus(1).library()).available()
    with col.use_registry(col.GroupRegistry()):
        with pytest.raises(col.BackendNotAvailableError, match="not available.*pip install cupy"):
            col.init_collective_group(1, 0, backend="nccl", group_name="gpu")
        assert not col.is_group_initialized("gpu")
    with pytest.raises(col.BackendNotAvailableError, match="nccl"):
        col.synchronize(0)


def test_synchronize_waits_for_the_device():
    gpus = StandInGpus(device_count=2)
    synchronize_device(1, library=gpus.library())
    assert gpus.calls("deviceSynchronize")[0][2] == 1
    for bad in (2, -1, True):
        with pytest.raises(ValueError, match="visible GPU"):
            synchronize_device(bad, library=gpus.library())


def test_synchronize_returns_once_the_work_queued_on_the_gpu_has_run(monkeypatch):
    from ray_collective.backends.nccl import backend
    gpus = StandInGpus(device_count=2)
    monkeypatch.setattr(backend, "load_library", gpus.library)  # CuPy's stand-in
    release = gpus.hold(gpus.default_streams[1])
    released, seen = threading.Event(), []
    waiter = threading.Thread(target=lambda: (col.synchronize(1),
                                              seen.append(released.is_set())))
    waiter.start()
    gpus.wait_for_call("deviceSynchronize")
    released.set()
    release()
    waiter.join(10)
    assert seen == [True] and gpus.calls("deviceSynchronize")[0][2] == 1
    with pytest.raises(ValueError, match="visible GPU"):
        col.synchronize(2)


def test_multigpu_variants_refuse_cpu_groups():
    def body(rank):
        with pytest.raises(col.UnsupportedOperationError, match="'nccl' backend"):
            col.allreduce_multigpu([np.ones(2)])
        with pytest.raises(col.UnsupportedOperationError, match="recv with one tensor"):
            col.recv_multigpu(np.ones(2), 0, 0)
        return True

    from ray_collective.testing import run_ranks
    assert run_ranks(1, body) == [True]


def test_importing_the_library_imports_neither_cupy_nor_torch():
    code = ("import sys, ray_collective, ray_collective.backends.nccl; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('cupy', 'torch')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


# ------------------------------------------------------------------ dtype and op mapping

@pytest.fixture
def library():
    return StandInGpus(device_count=1).library()


@pytest.mark.parametrize("dtype, op, expected", [
    ("float32", col.ReduceOp.SUM, (C["NCCL_FLOAT32"], 1, C["NCCL_SUM"])),
    ("bfloat16", col.ReduceOp.MAX, (C["NCCL_BFLOAT16"], 1, C["NCCL_MAX"])),
    ("uint64", col.ReduceOp.PRODUCT, (C["NCCL_UINT64"], 1, C["NCCL_PROD"])),
    ("int8", col.ReduceOp.AVG, (C["NCCL_INT8"], 1, C["NCCL_AVG"])),
    ("bool", col.ReduceOp.SUM, (C["NCCL_UINT8"], 1, C["NCCL_MAX"])),
    ("bool", col.ReduceOp.PRODUCT, (C["NCCL_UINT8"], 1, C["NCCL_MIN"])),
    ("complex128", col.ReduceOp.AVG, (C["NCCL_FLOAT64"], 2, C["NCCL_AVG"])),
])
def test_reduction_formats(library, dtype, op, expected):
    fmt = reduction_format(library, dtype, op)
    assert (fmt.datatype, fmt.per_element, fmt.op) == expected


@pytest.mark.parametrize("dtype, itemsize, expected", [
    ("float16", 2, (C["NCCL_FLOAT16"], 1)),
    ("int16", 2, (C["NCCL_UINT8"], 2)),
    ("complex64", 8, (C["NCCL_UINT8"], 8)),
    ("bool", 1, (C["NCCL_UINT8"], 1)),
])
def test_movement_formats(library, dtype, itemsize, expected):
    fmt = movement_format(library, dtype, itemsize)
    assert (fmt.datatype, fmt.per_element, fmt.op) == expected + (-1,)


def test_bfloat16_on_an_nccl_without_it_moves_as_bytes_and_refuses_reductions():
    old = StandInGpus(device_count=1, version=2708, without=["NCCL_BFLOAT16", "NCCL_AVG"])
    fmt = movement_format(old.library(), "bfloat16", 2)
    assert (fmt.datatype, fmt.per_element) == (C["NCCL_UINT8"], 2)
    with pytest.raises(TypeError, match="bfloat16 reductions need NCCL 2.10"):
        reduction_format(old.library(), "bfloat16", col.ReduceOp.SUM)


@pytest.mark.parametrize("code, text", [(21805, "2.18.5"), (2708, "2.7.8"), (30001, "3.0.1")])
def test_format_version(code, text):
    assert format_version(code) == text



def _ray_rank(store, rank, world_size=2):
    """A rank of the ``ray`` backend announcing its terms for group "g" in the same store."""
    from ray_collective.backends.arrivals import Arrivals, Terms
    from ray_collective.backends.key_value import KeyValue
    import os
    return Arrivals(KeyValue(store), "01000000", "g", rank, Terms(world_size, "ray"), "node",
                    os.getpid(), 300.0)


def test_an_nccl_rank_joining_beside_ray_backend_ranks_is_refused_at_once():
    store = StandInKeyValueStore()
    gpus = StandInGpus(device_count=2)
    _ray_rank(store, 0).announce()
    factory = NcclBackendFactory(rendezvous=RayRendezvous(job_id="01000000", store=store,
                                                          node="node"),
                                 devices=[1], library=gpus.library())
    started = time.monotonic()
    with pytest.raises(col.JoinMismatchError,
                       match="rank 0 joins with backend='ray', rank 1 with backend='nccl'"):
        factory.create("g", 2, 1, 300.0)
    assert time.monotonic() - started < 5


def test_a_waiting_nccl_rank_is_told_when_a_ray_backend_rank_comes_later():
    store = StandInKeyValueStore()
    gpus = StandInGpus(device_count=2)
    factory = NcclBackendFactory(rendezvous=RayRendezvous(job_id="01000000", store=store,
                                                          node="node"),
                                 devices=[0], library=gpus.library())
    outcome = {}

    def rank0():
        started = time.monotonic()
        try:
            factory.create("g", 2, 0, 300.0)
        except col.JoinMismatchError as err:
            outcome["error"], outcome["after_s"] = str(err), time.monotonic() - started

    thread = threading.Thread(target=rank0, name="rank-0")
    thread.start()
    deadline = time.monotonic() + 30
    while not any(b"#arrivals" in k for k in store.values) and time.monotonic() < deadline:
        time.sleep(0.01)   # rank 0 has announced
    with pytest.raises(col.JoinMismatchError, match="backend='nccl'"):
        _ray_rank(store, 1).announce()
    thread.join(30)
    assert not thread.is_alive()
    assert "rank 0 joins with backend='nccl', rank 1 with backend='ray'" in outcome["error"]
    assert outcome["after_s"] < 30
    assert store.values == {}

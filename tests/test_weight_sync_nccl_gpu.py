"""Weight sync's GPU path on a real GPU with CuPy (and NCCL, with two GPUs or more).

Marked ``gpu`` and skipped, with the reason, where CuPy or a GPU is missing; nothing here has
run yet (no GPU has been available to this project's weight sync). On one GPU: the CuPy calls
weight sync makes (arrays over memory, staging copies on its own streams, control words to and
from the host, the order with the caller's stream). With two GPUs or more: whole syncs, members
as threads of this process, one GPU each, CuPy arrays and torch CUDA tensors (bfloat16
included where torch has CUDA), compared bit for bit with the publisher's.

    python -m pytest -q -m gpu tests/test_weight_sync_nccl_gpu.py
"""

import time

import numpy as np
import pytest

import ray_collective as col
from ray_collective.weight_sync.gpu import DeviceBytes, GpuMemory, GpuStaging
from support.weight_sync import run_members


def _find():
    try:
        import cupy
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as err:  # ImportError, or CuPy's CUDARuntimeError without a driver
        return None, 0, f"CuPy with a usable GPU is missing ({type(err).__name__}: {err})"
    return (cupy, count, "") if count else (None, 0, "no GPU is visible")


CUPY, GPUS, WHY_NOT = _find()
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(CUPY is None, reason=f"needs a GPU and CuPy: {WHY_NOT}")]


def _bytes(array):
    return DeviceBytes(int(array.data.ptr), int(array.nbytes), array)


def test_staging_copies_on_the_libraries_streams_pack_and_unpack_bit_for_bit():
    memory = GpuMemory(CUPY, 0, "cupy")
    try:
        parts = [CUPY.arange(n, dtype=CUPY.float32) * 3 for n in (5, 300, 17)]
        views = [_bytes(p.view(CUPY.uint8)) for p in parts]
        memory.after_caller(CUPY.cuda.get_current_stream().ptr)     # arange's kernels
        staging = GpuStaging(memory, sum(v.nbytes for v in views))
        payload = staging.buffer(1, sum(v.nbytes for v in views))
        staging.pack(1, views, payload)
        copies = [CUPY.zeros_like(p) for p in parts]
        memory.after_caller(CUPY.cuda.get_current_stream().ptr)     # zeros_like's
        staging.unpack(1, [_bytes(c.view(CUPY.uint8)) for c in copies], payload)
        memory.wait_all(time.monotonic() + 10, "test")
        for part, copy in zip(parts, copies):
            assert CUPY.asnumpy(copy).tobytes() == CUPY.asnumpy(part).tobytes()
        packed = CUPY.asnumpy(memory.array(payload))
        assert packed.tobytes() == b"".join(CUPY.asnumpy(p).tobytes() for p in parts)
    finally:
        memory.close()


def test_control_words_go_to_the_gpu_and_back():
    memory = GpuMemory(CUPY, 0, "cupy")
    try:
        words = np.arange(12, dtype=np.int64) * -7
        on_gpu = memory.upload(words, time.monotonic() + 10)
        assert CUPY.asnumpy(memory.array(on_gpu)).view(np.int64).tolist() == words.tolist()
        back = memory.download(on_gpu, np.zeros_like(words), time.monotonic() + 10)
        assert back.tolist() == words.tolist()
    finally:
        memory.close()


def test_the_streams_wait_for_the_callers_and_the_caller_for_them():
    memory = GpuMemory(CUPY, 0, "cupy")
    try:
        source = CUPY.zeros(1 << 24, CUPY.uint8)
        target = CUPY.zeros_like(source)
        CUPY.cuda.Device(0).synchronize()
        caller = CUPY.cuda.Stream(non_blocking=True)
        with caller:
            source += 1                                  # the caller's work, queued
        memory.after_caller(caller.ptr)
        memory.copy(_bytes(target), _bytes(source), 0)    # must see the caller's work
        memory.before_caller(caller.ptr)
        with caller:
            total = int(target.sum())                     # must see the copy
        assert total == source.size
    finally:
        memory.close()


def _sync(states_of, devices, version=1):
    """One sync, publisher on devices[0], subscriber on devices[1]: the subscriber's arrays."""
    from ray_collective.backends.nccl import InProcessRendezvous, NcclBackendFactory
    rendezvous = InProcessRendezvous()

    def member(role, device):
        def body():
            CUPY.cuda.Device(device).use()
            col.init_weight_sync("g", role, 0, 1, 1, timeout=60, bucket_bytes=1 << 20,
                                 backend=NcclBackendFactory(rendezvous=rendezvous,
                                                            devices=[device]))
            state = states_of(role, device)
            if role == "publisher":
                col.publish_weights(state, "g", version=version)
            else:
                assert col.receive_weights(state, "g") == version
            col.destroy_weight_sync("g")
            return state
        return body

    return run_members([member("publisher", devices[0]), member("subscriber", devices[1])])


@pytest.mark.skipif(GPUS < 2, reason="a sync needs two GPUs (one per member)")
def test_cupy_arrays_arrive_bit_for_bit_on_another_gpu():
    rng = np.random.default_rng(0)
    host = {"big": rng.standard_normal(3 << 20).astype(np.float32),
            "small": rng.standard_normal(1000).astype(np.float16),
            "ints": rng.integers(-9, 9, 77).astype(np.int64)}

    def states_of(role, device):
        with CUPY.cuda.Device(device):
            if role == "publisher":
                return {k: CUPY.asarray(v) for k, v in host.items()}
            return {k: CUPY.zeros(v.shape, v.dtype) for k, v in host.items()}

    publisher, subscriber = _sync(states_of, (0, 1))
    for key in host:
        assert CUPY.asnumpy(subscriber[key]).tobytes() == host[key].tobytes()


@pytest.mark.skipif(GPUS < 2, reason="a sync needs two GPUs (one per member)")
def test_torch_cuda_tensors_bfloat16_included_arrive_bit_for_bit():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    generator = torch.Generator().manual_seed(0)
    host = {"w": torch.randn(2 << 20, generator=generator).to(torch.bfloat16),
            "b": torch.randn(33, generator=generator)}

    def states_of(role, device):
        where = f"cuda:{device}"
        if role == "publisher":
            return {k: v.to(where) for k, v in host.items()}
        return {k: torch.zeros_like(v, device=where) for k, v in host.items()}

    publisher, subscriber = _sync(states_of, (0, 1))
    for key in host:
        assert torch.equal(subscriber[key].cpu().view(torch.int16),
                           host[key].view(torch.int16))

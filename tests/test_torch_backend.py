"""The ``ray_collective`` torch.distributed backend in Ray actors (2 and 4 ranks): every
collective's result equals the reference computed from every rank's input (and Gloo's, run on
a Gloo group of the same ranks in the same test), for the reductions and dtypes torch users
send, non-contiguous tensors and tensors that require grad; async work, its future, and what
is refused (other reductions, CUDA tensors, a process outside Ray)."""

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from support.paths import REPO_DIR  # noqa: E402
from support.torch_ranks import four, run_torch_ranks  # noqa: E402,F401 - four: a fixture


DTYPES = ("float32", "float64", "int32", "int64", "float16", "bfloat16")
OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX")


def _input(rank, dtype, op, shape=(3, 5)):
    """Rank ``rank``'s small integer input: sums and products stay exact in every dtype."""
    generator = torch.Generator().manual_seed(100 + rank)
    low, high = (1, 3) if op == "PRODUCT" else (-8, 9)
    return torch.randint(low, high, shape, generator=generator).to(getattr(torch, dtype))


def _reference(size, dtype, op):
    stack = torch.stack([_input(r, dtype, op).double() for r in range(size)])
    result = {"SUM": stack.sum(0), "PRODUCT": stack.prod(0), "MIN": stack.amin(0),
              "MAX": stack.amax(0), "AVG": stack.sum(0) / size}[op]
    if dtype.startswith("int") and op == "AVG":
        result = torch.trunc(result)
    return result.to(getattr(torch, dtype))


def _all_reduce_everything(rank, size):
    import torch.distributed as dist
    gloo = dist.new_group(backend="gloo")
    out = {}
    for dtype in DTYPES:
        for op in OPS:
            mine = _input(rank, dtype, op)
            dist.all_reduce(mine, op=getattr(dist.ReduceOp, op))
            with_gloo = None
            if op != "AVG" and dtype != "float16":
                with_gloo = _input(rank, dtype, op)
                dist.all_reduce(with_gloo, op=getattr(dist.ReduceOp, op), group=gloo)
            out[dtype, op] = (mine, with_gloo)
    return out


@pytest.mark.parametrize("size", [2, 4])
def test_all_reduce_every_op_and_dtype_equals_the_reference_and_gloo(ray_session, four, size):
    results = run_torch_ranks(ray_session, four[:size], _all_reduce_everything)
    for (dtype, op), _ in results[0].items():
        expected = _reference(size, dtype, op)
        for rank in range(size):
            mine, with_gloo = results[rank][dtype, op]
            assert mine.dtype == expected.dtype
            assert torch.equal(mine, expected), (rank, dtype, op)
            if with_gloo is not None:
                assert torch.equal(mine, with_gloo), (rank, dtype, op)


def _copies(rank, size):
    import torch.distributed as dist
    out = {}
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * rank
    b = x.clone()
    dist.broadcast(b, src=size - 1)
    out["broadcast"] = b
    listed = [torch.empty(2, 3) for _ in range(size)]
    dist.all_gather(listed, x)
    out["all_gather"] = torch.stack(listed)
    flat = torch.empty(size * 2, 3)
    dist.all_gather_into_tensor(flat, x)
    out["all_gather_into_tensor"] = flat
    parts = [torch.full((4,), float(rank + 10 * j)) for j in range(size)]
    mine = torch.empty(4)
    dist.reduce_scatter(mine, parts)
    out["reduce_scatter"] = mine
    whole = torch.cat(parts)
    mine2 = torch.empty(4)
    dist.reduce_scatter_tensor(mine2, whole, op=dist.ReduceOp.MAX)
    out["reduce_scatter_tensor"] = mine2
    dist.barrier()
    # Non-contiguous (a transposed view) and requires_grad, in place.
    t = (torch.arange(12, dtype=torch.float64).reshape(3, 4) * (rank + 1)).T
    assert not t.is_contiguous()
    dist.all_reduce(t)
    out["non_contiguous"] = t
    w = torch.full((5,), float(rank), requires_grad=True)
    dist.all_reduce(w)
    out["requires_grad"] = (w.detach().clone(), w.requires_grad)
    # 2 MiB: on the worker thread where the group overlaps its calls (work.overlaps), else inline.
    big = torch.full((1 << 19,), float(rank + 1))
    work = dist.all_reduce(big, async_op=True)
    future = work.get_future()
    work.wait()
    out["async"] = (work.is_completed(), float(future.wait()[0][0]), float(big[-1]))
    small = torch.ones(3)
    work = dist.all_reduce(small, async_op=True)
    out["async_small"] = (work.wait(), work.is_completed(), small.tolist())
    return out


@pytest.mark.parametrize("size", [2, 4])
def test_copies_and_reductions_of_lists_equal_the_reference(ray_session, four, size):
    results = run_torch_ranks(ray_session, four[:size], _copies)
    x = [torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * r for r in range(size)]
    every = sum(range(1, size + 1))
    for rank, out in enumerate(results):
        assert torch.equal(out["broadcast"], x[size - 1])
        assert torch.equal(out["all_gather"], torch.stack(x))
        assert torch.equal(out["all_gather_into_tensor"], torch.cat(x))
        summed = sum(float(r + 10 * rank) for r in range(size))
        assert out["reduce_scatter"].tolist() == [summed] * 4
        assert out["reduce_scatter_tensor"].tolist() == [float(size - 1 + 10 * rank)] * 4
        expected = (torch.arange(12, dtype=torch.float64).reshape(3, 4) * every).T
        assert torch.equal(out["non_contiguous"], expected)
        value, requires_grad = out["requires_grad"]
        assert requires_grad and value.tolist() == [float(sum(range(size)))] * 5
        assert out["async"] == (True, float(every), float(every))
        assert out["async_small"] == (True, True, [float(size)] * 3)


def _point_to_point(rank, size):
    import torch.distributed as dist
    right, left = (rank + 1) % size, (rank - 1) % size
    got = torch.empty(3, dtype=torch.bfloat16)
    # irecv before send on every rank: the ring would deadlock if the send waited behind it.
    request = dist.irecv(got, src=left, tag=7)
    dist.send(torch.full((3,), float(rank), dtype=torch.bfloat16), dst=right, tag=7)
    request.wait()
    tagged = {}
    if rank == 0:
        dist.send(torch.full((2,), 1.0), dst=1, tag=1)
        dist.send(torch.full((2,), 2.0), dst=1, tag=2)
    elif rank == 1:
        second, first = torch.empty(2), torch.empty(2)
        work = dist.irecv(second, src=0, tag=2)
        dist.recv(first, src=0, tag=1)
        work.wait()
        tagged = {"first": first.tolist(), "second": second.tolist()}
    dist.barrier()
    return got.float().tolist(), tagged


@pytest.mark.parametrize("size", [2, 4])
def test_send_and_recv_around_a_ring_with_tags(ray_session, four, size):
    results = run_torch_ranks(ray_session, four[:size], _point_to_point)
    for rank, (got, tagged) in enumerate(results):
        assert got == [float((rank - 1) % size)] * 3
    assert results[1][1] == {"first": [1.0, 1.0], "second": [2.0, 2.0]}


def _refusals(rank, size):
    import torch.distributed as dist
    errors = {}
    for name, op in (("PREMUL_SUM", dist._make_nccl_premul_sum(2.0)),
                     ("BAND", dist.ReduceOp.BAND)):
        try:
            dist.all_reduce(torch.ones(2), op=op)
        except ValueError as error:
            errors[name] = str(error)
    dist.all_reduce(torch.ones(2))  # the group is still usable
    return errors, dist.get_backend()


def test_other_reductions_are_refused_clearly_and_the_group_stays_usable(ray_session, four):
    results = run_torch_ranks(ray_session, four[:2], _refusals)
    for errors, backend in results:
        assert backend == "ray_collective"
        assert set(errors) == {"PREMUL_SUM", "BAND"}
        assert all("SUM, AVG, PRODUCT, MIN and MAX" in message for message in errors.values())
        assert "PREMUL_SUM" in errors["PREMUL_SUM"]


def test_the_device_form_with_nccl_initialises_and_runs_cpu_tensors(ray_session, four):
    results = run_torch_ranks(ray_session, four[:2], _refusals,
                              backend="cpu:ray_collective,cuda:nccl")
    assert [backend for _, backend in results] == ["cpu:ray_collective,cuda:nccl"] * 2


def test_a_tensor_off_the_cpu_is_refused_naming_the_nccl_form():
    from ray_collective.torch.process_group import cpu_tensor
    with pytest.raises(ValueError, match="cpu:ray_collective,cuda:nccl"):
        cpu_tensor(torch.empty(2, device="meta"), "rank 0 of group 'g', all_reduce")


def test_a_sparse_tensor_is_refused_naming_to_dense():
    from ray_collective.torch.process_group import cpu_tensor
    sparse = torch.eye(2).to_sparse()
    with pytest.raises(ValueError, match="dense tensors only.*to_dense"):
        cpu_tensor(sparse, "rank 0 of group 'g', all_reduce")


def test_outside_ray_init_process_group_fails_at_once_naming_ray(tmp_path):
    code = ("import torch.distributed as dist, ray_collective.torch\n"
            f"dist.init_process_group('ray_collective', init_method='file://{tmp_path}/store',"
            " rank=0, world_size=1)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO_DIR, timeout=120)
    assert done.returncode != 0
    assert "needs Ray" in done.stderr and "inside a Ray" in done.stderr


def test_importing_the_package_does_not_import_torch():
    code = "import sys, ray_collective; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO_DIR, check=True, timeout=120)
    assert done.stdout.strip() == "False"


def test_the_short_path_reads_the_op_torch_was_given_and_no_other():
    # all_reduce's short path finds the op by the hash of torch's ReduceOp; the reference is
    # the op the general path reads (library_op), and a refused op must find none.
    import torch.distributed as dist

    from ray_collective.torch.process_group import _OPS_BY_VALUE, library_op
    refused = [dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR,
               dist._make_nccl_premul_sum(0.0), dist._make_nccl_premul_sum(2.0)]
    for op in [dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.PRODUCT, dist.ReduceOp.MIN,
               dist.ReduceOp.MAX] + refused:
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        found = _OPS_BY_VALUE.get(hash(opts.reduceOp))
        if any(op is r for r in refused):
            assert found is None, op
        else:
            assert found is library_op(op, "test"), op

"""DistributedDataParallel and FSDP2 over the ``ray_collective`` backend train as over Gloo: the same
model, data and seed, 50 steps on 2 and 4 ranks in Ray actors, with both backends in the same
processes (``ray_collective`` the default group, Gloo a group of the same ranks). On 2 ranks a
sum of two gradients cannot depend on the order of its additions, so the parameters agree bit
for bit; on 4 they agree within the rounding of the sums (see ``_bound``)."""

import pytest

torch = pytest.importorskip("torch")

from support.torch_ranks import four, run_torch_ranks  # noqa: E402,F401 - four: a fixture

STEPS = 50
LR = 0.05


def _model():
    # 296k parameters: DDP's first bucket (1 MiB) and a smaller second one, so that where the
    # group overlaps its calls (work.overlaps), they run both on the worker thread and inline.
    return torch.nn.Sequential(torch.nn.Linear(32, 1024), torch.nn.Tanh(),
                               torch.nn.Linear(1024, 256))


def _train(rank, size, hook):
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel
    gloo = dist.new_group(backend="gloo")
    trained = {}
    for backend, group in (("gloo", gloo), ("ray_collective", None)):
        torch.manual_seed(0)
        model = DistributedDataParallel(_model(), process_group=group)
        if hook:
            model.register_comm_hook(group, getattr(default_hooks, hook))
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        data = torch.Generator().manual_seed(1000 + rank)
        teacher = torch.randn(32, 256, generator=torch.Generator().manual_seed(7)) / 8
        losses, largest_gradient = [], 0.0
        for _ in range(STEPS):
            x = torch.randn(16, 32, generator=data)
            y = x @ teacher
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            largest_gradient = max(largest_gradient, max(float(p.grad.abs().max())
                                                         for p in model.parameters()))
            optimizer.step()
            losses.append(float(loss.detach()))
        trained[backend] = ([p.detach().clone() for p in model.parameters()], losses,
                            largest_gradient)
    return trained


def _bound(size, largest_gradient, largest_parameter):
    """How far apart two trainings may drift when only the order of the gradient sums differs:
    each step's averaged gradient differs by at most ``size - 1`` float32 roundings of its
    largest magnitude, which SGD scales by ``LR``, and the update of a parameter rounds to
    within one rounding of its magnitude either way; over ``STEPS`` steps (the model's own
    arithmetic is the same in both)."""
    eps = torch.finfo(torch.float32).eps
    return STEPS * eps * (LR * (size - 1) * largest_gradient + largest_parameter)


@pytest.mark.parametrize("size, hook", [(2, None), (2, "allreduce_hook"), (4, None)])
def test_ddp_trains_to_gloo_s_parameters(ray_session, four, size, hook):
    results = run_torch_ranks(ray_session, four[:size], _train, hook, timeout=300)
    _assert_trained_like_gloo(results, size)
    for rank in range(size):
        for mine, first_rank in zip(results[rank]["ray_collective"][0],
                                    results[0]["ray_collective"][0]):
            assert torch.equal(mine, first_rank)


def _assert_trained_like_gloo(results, size):
    """Every rank's parameters and losses over ``ray_collective`` against rank 0's over Gloo:
    equal on 2 ranks, within ``_bound`` on more; and Gloo's training learned."""
    gloo_params, gloo_losses, largest = results[0]["gloo"][:3]
    for rank in range(size):
        params, losses = results[rank]["ray_collective"][:2]
        for mine, reference in zip(params, gloo_params):
            if size == 2:
                assert torch.equal(mine, reference), rank
            else:
                bound = _bound(size, largest, float(reference.abs().max()))
                assert float((mine - reference).abs().max()) <= bound, rank
        if size == 2:
            assert losses == results[rank]["gloo"][1]
    assert gloo_losses[-1] < gloo_losses[0]


def _train_fully_sharded(rank, size):
    """FSDP2 (``fully_shard``) on CPU over each backend: its parameters sharded over the ranks,
    gathered before each layer's use (``all_gather_into_tensor``) and its gradients
    reduce-scattered (``reduce_scatter_tensor``), so every step goes through the backend."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard
    meshes = (("gloo", DeviceMesh.from_group(dist.new_group(backend="gloo"), "cpu")),
              ("ray_collective", init_device_mesh("cpu", (size,))))
    trained = {}
    for backend, mesh in meshes:
        torch.manual_seed(0)
        model = _model()
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        data = torch.Generator().manual_seed(1000 + rank)
        teacher = torch.randn(32, 256, generator=torch.Generator().manual_seed(7)) / 8
        losses, largest_gradient = [], 0.0
        for _ in range(STEPS):
            x = torch.randn(16, 32, generator=data)
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), x @ teacher)
            loss.backward()
            largest_gradient = max(largest_gradient, max(float(p.grad.full_tensor().abs().max())
                                                         for p in model.parameters()))
            optimizer.step()
            losses.append(float(loss.detach()))
        shards = [p.to_local().detach().clone() for p in model.parameters()]
        trained[backend] = ([p.full_tensor().detach().clone() for p in model.parameters()],
                            losses, largest_gradient, [s.numel() for s in shards])
    return trained


@pytest.mark.parametrize("size", [2, 4])
def test_fully_sharded_data_parallel_trains_to_gloo_s_parameters(ray_session, four, size):
    results = run_torch_ranks(ray_session, four[:size], _train_fully_sharded, timeout=300)
    _assert_trained_like_gloo(results, size)
    full_sizes = [p.numel() for p in results[0]["gloo"][0]]
    for rank in range(size):
        # Each rank holds its part of every parameter only (dim-0 shards).
        assert sum(results[rank]["ray_collective"][3]) < sum(full_sizes)

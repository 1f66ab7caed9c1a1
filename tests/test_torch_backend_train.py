"""Ray Train's ``TorchTrainer`` on 4 CPU workers with ``TorchConfig(backend="ray_collective")``
(the backend registered in the workers by ``worker_runtime_env``) trains with the losses Gloo
gives: each worker trains the same model twice, over the run's default group and over a Gloo
group of the same workers, and the losses agree within the rounding of the gradient sums."""

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("ray.train")

STEPS = 10


def _train_loop(config):
    import ray.train
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    rank = ray.train.get_context().get_world_rank()
    gloo = dist.new_group(backend="gloo")
    losses = {}
    for backend, group in (("ray_collective", None), ("gloo", gloo)):
        torch.manual_seed(0)
        model = DistributedDataParallel(torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)), process_group=group)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        data = torch.Generator().manual_seed(rank)
        losses[backend] = []
        for _ in range(STEPS):
            x = torch.randn(16, 8, generator=data)
            loss = torch.nn.functional.mse_loss(model(x).squeeze(1), x.sum(1))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses[backend].append(float(loss.detach()))
    losses["default backend"] = dist.get_backend()
    with open(f"{config['out']}/rank{rank}.json", "w") as out:
        json.dump(losses, out)


def test_torch_trainer_with_the_ray_collective_backend_trains_like_gloo(ray_session, tmp_path):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from ray_collective.torch import worker_runtime_env
    trainer = TorchTrainer(
        _train_loop, train_loop_config={"out": str(tmp_path)},
        # A quarter of a CPU each: the suite's Ray has two, and a bundle may not be empty.
        scaling_config=ScalingConfig(num_workers=4, resources_per_worker={"CPU": 0.25}),
        torch_config=TorchConfig(backend="ray_collective", timeout_s=120),
        run_config=RunConfig(name="ray_collective_torch", storage_path=str(tmp_path / "runs"),
                             worker_runtime_env=worker_runtime_env()))
    result = trainer.fit()
    assert result.error is None
    eps = torch.finfo(torch.float32).eps
    for rank in range(4):
        losses = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert losses["default backend"] == "ray_collective"
        assert len(losses["ray_collective"]) == STEPS
        for mine, gloo in zip(losses["ray_collective"], losses["gloo"]):
            # A loss of the same model within float32 rounding of the sums that trained it.
            assert abs(mine - gloo) <= 64 * STEPS * eps * abs(gloo), (rank, mine, gloo)
        assert losses["ray_collective"][-1] < losses["ray_collective"][0]


def test_worker_runtime_env_keeps_the_user_s_environment_and_refuses_a_second_hook():
    from ray_collective.torch import worker_runtime_env
    from ray_collective.torch.train import SETUP_HOOK
    env = worker_runtime_env({"env_vars": {"A": "1"}, "pip": ["x"]})
    assert env["pip"] == ["x"] and env["env_vars"]["A"] == "1"
    assert SETUP_HOOK in env["env_vars"].values()
    with pytest.raises(ValueError, match="already sets a worker setup hook"):
        worker_runtime_env({"worker_process_setup_hook": "elsewhere.setup"})

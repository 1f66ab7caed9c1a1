"""DistributedDataParallel on Ray actors, with ``backend="ray_collective"`` instead of Gloo.

Run it with ``python examples/torch_ddp.py [--ranks 2]``. Each actor imports
``ray_collective.torch`` (which registers the backend), joins the process group at an address
rank 0 chose, trains a small regression model for 30 steps on data of its own, and reports its
losses and a checksum of its parameters: DDP keeps every rank's parameters the same.
"""

import argparse
import socket
from datetime import timedelta

import ray
import torch


@ray.remote(num_cpus=0)
class Trainer:
    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size

    def address(self) -> str:
        """Where rank 0 will listen for the process group's store."""
        with socket.socket() as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def train(self, init_method: str, steps: int = 30) -> dict:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        import ray_collective.torch  # noqa: F401 - registers backend "ray_collective"

        dist.init_process_group("ray_collective", init_method=init_method, rank=self.rank,
                                world_size=self.world_size, timeout=timedelta(seconds=120))
        torch.manual_seed(0)  # the same initial model everywhere (DDP broadcasts rank 0's too)
        model = DistributedDataParallel(torch.nn.Sequential(
            torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        data = torch.Generator().manual_seed(self.rank)  # each rank its own batches
        target = torch.linspace(-1, 1, 16)
        losses = []
        for _ in range(steps):
            x = torch.randn(32, 16, generator=data)
            loss = torch.nn.functional.mse_loss(model(x).squeeze(1), x @ target)
            optimizer.zero_grad()
            loss.backward()  # gradients averaged over the ranks by ray_collective
            optimizer.step()
            losses.append(float(loss.detach()))
        checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
        dist.destroy_process_group()
        return {"rank": self.rank, "first loss": losses[0], "last loss": losses[-1],
                "checksum": checksum}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, default=2)
    ranks = parser.parse_args().ranks
    ray.init(address="local", include_dashboard=False, logging_level="ERROR")
    trainers = [Trainer.remote(rank, ranks) for rank in range(ranks)]
    init_method = ray.get(trainers[0].address.remote())
    reports = ray.get([t.train.remote(init_method) for t in trainers])
    for report in reports:
        print(f"rank {report['rank']}: loss {report['first loss']:.4f} -> "
              f"{report['last loss']:.4f}")
    print("parameters equal on every rank:",
          len({report["checksum"] for report in reports}) == 1)
    ray.shutdown()


if __name__ == "__main__":
    main()

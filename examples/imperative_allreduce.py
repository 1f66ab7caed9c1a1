"""The imperative pattern of ``ray.util.collective``: each actor joins the group itself.

Starts a local Ray (nothing to set up), four actors with numpy buffers, and runs allreduce,
broadcast and allgather between them on the native ``ray`` backend (shared memory on this
machine). Run it with ``python examples/imperative_allreduce.py``.
"""

import numpy as np
import ray

import ray_collective as col

WORLD_SIZE = 4


@ray.remote(num_cpus=0)
class Worker:
    def __init__(self, rank: int):
        self.rank = rank
        self.gradient = np.full(1_000_000, float(rank + 1), dtype=np.float32)

    def setup(self, world_size: int) -> int:
        col.init_collective_group(world_size, self.rank, backend="ray", group_name="train")
        return col.get_rank("train")

    def step(self) -> dict:
        col.allreduce(self.gradient, group_name="train", op=col.ReduceOp.AVG)
        weights = np.arange(4.0) if self.rank == 0 else np.zeros(4)
        col.broadcast(weights, src_rank=0, group_name="train")
        ranks = [np.zeros(1, np.int64) for _ in range(WORLD_SIZE)]
        col.allgather(ranks, np.array([self.rank], np.int64), group_name="train")
        return {"rank": self.rank, "mean gradient": float(self.gradient[0]),
                "weights": weights.tolist(), "allgather": [int(r[0]) for r in ranks]}

    def teardown(self) -> None:
        col.destroy_collective_group("train")


def main() -> None:
    ray.init(address="local", include_dashboard=False, logging_level="ERROR")
    workers = [Worker.remote(rank) for rank in range(WORLD_SIZE)]
    print("joined ranks:", ray.get([w.setup.remote(WORLD_SIZE) for w in workers]))
    for result in ray.get([w.step.remote() for w in workers]):
        print(result)
    ray.get([w.teardown.remote() for w in workers])
    expected = sum(range(1, WORLD_SIZE + 1)) / WORLD_SIZE
    print(f"every rank holds the average gradient {expected}: allreduce (AVG) over 4 MB per "
          f"rank, broadcast from rank 0 and allgather of the ranks, on backend 'ray'")
    ray.shutdown()


if __name__ == "__main__":
    main()

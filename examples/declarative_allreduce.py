"""The declarative pattern of ``ray.util.collective``: the driver forms the group.

The actor class knows nothing about collectives: ``declare_collective_group`` makes each actor
join from the driver, and the actors' own methods then call ``col.allreduce``. Run it with
``python examples/declarative_allreduce.py``.
"""

import numpy as np
import ray

import ray_collective as col


@ray.remote(num_cpus=0)
class Worker:
    def __init__(self):
        self.buffer = np.ones(10, dtype=np.float32)

    def compute(self) -> list:
        col.allreduce(self.buffer, group_name="177")
        return self.buffer.tolist()


def main() -> None:
    ray.init(address="local", include_dashboard=False, logging_level="ERROR")
    workers = [Worker.remote() for _ in range(2)]
    col.declare_collective_group(workers, world_size=2, ranks=[0, 1], backend="ray",
                                 group_name="177")
    results = ray.get([w.compute.remote() for w in workers])
    print("rank 0:", results[0])
    print("rank 1:", results[1])
    col.destroy_collective_group("177")
    ray.shutdown()


if __name__ == "__main__":
    main()

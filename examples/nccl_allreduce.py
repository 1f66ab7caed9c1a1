"""Two Ray actors with one GPU each allreduce a CuPy array over NCCL: the pattern of
``ray.util.collective``'s documentation, with ``import ray_collective as col`` instead.

Each actor joins the group itself (``backend="nccl"``); the NCCL unique id travels through
Ray's key-value store. Needs a Ray cluster with two GPUs and CuPy with NCCL in the actors
(``pip install cupy-cuda12x nvidia-nccl-cu12``). Run it with
``python examples/nccl_allreduce.py``; without two GPUs it says so and exits.
"""

import sys

import ray

import ray_collective as col

WORLD_SIZE = 2


@ray.remote(num_gpus=1)
class Worker:
    def __init__(self):
        import cupy
        self.gradient = cupy.ones((4,), dtype=cupy.float32)

    def setup(self, world_size: int, rank: int) -> int:
        col.init_collective_group(world_size, rank, backend="nccl", group_name="default")
        return col.get_rank("default")

    def compute(self) -> list:
        col.allreduce(self.gradient, group_name="default")  # in place, on the GPU
        return self.gradient.get().tolist()  # to the host: the driver may have no GPU

    def compute_async(self) -> list:
        work = col.allreduce(self.gradient, group_name="default", op=col.ReduceOp.AVG,
                             async_op=True)
        work.wait(timeout=60)  # the GPU has finished when wait returns
        return self.gradient.get().tolist()

    def teardown(self) -> None:
        col.destroy_collective_group("default")


def main() -> int:
    ray.init(logging_level="ERROR")
    gpus = ray.cluster_resources().get("GPU", 0)
    if gpus < WORLD_SIZE:
        print(f"this example needs {WORLD_SIZE} GPUs in the Ray cluster; it has {gpus:g}")
        ray.shutdown()
        return 1
    workers = [Worker.remote() for _ in range(WORLD_SIZE)]
    print("joined ranks:", ray.get([w.setup.remote(WORLD_SIZE, rank)
                                    for rank, w in enumerate(workers)]))
    print("after allreduce (SUM):", ray.get([w.compute.remote() for w in workers]))
    print("after allreduce (AVG, async):", ray.get([w.compute_async.remote() for w in workers]))
    ray.get([w.teardown.remote() for w in workers])
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

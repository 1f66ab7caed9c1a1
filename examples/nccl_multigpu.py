"""One process driving several GPUs: the ``*_multigpu`` collectives of the ``nccl`` backend.

Each Ray actor owns ``--gpus-per-actor`` GPUs (Ray makes exactly those visible to it, and the
group uses every GPU the actor sees) and passes one CuPy array per GPU; the collective runs
over every GPU of every actor, with GPU ``i`` of rank ``r`` numbered ``r * k + i``. Every actor
must own the same number of GPUs, or the group refuses to form. Needs CuPy with NCCL and
``actors * gpus-per-actor`` GPUs; run it with
``python examples/nccl_multigpu.py --actors 1 --gpus-per-actor 2``.
"""

import argparse
import sys

import ray

import ray_collective as col


@ray.remote
class MultiGpuWorker:
    def __init__(self, rank: int):
        import cupy
        self.rank = rank
        self.gpus = cupy.cuda.runtime.getDeviceCount()
        self.tensors = []
        for i in range(self.gpus):
            with cupy.cuda.Device(i):
                self.tensors.append(cupy.full((3,), float(rank * self.gpus + i)))

    def setup(self, world_size: int) -> None:
        col.init_collective_group(world_size, self.rank, backend="nccl", group_name="multi")

    def run(self) -> dict:
        import cupy
        col.allreduce_multigpu(self.tensors, group_name="multi")
        summed = [t.get().tolist() for t in self.tensors]
        col.broadcast_multigpu(self.tensors, src_rank=0, src_tensor=0, group_name="multi")
        everyone = []
        for i in range(self.gpus):
            with cupy.cuda.Device(i):
                everyone.append([cupy.zeros((3,)) for _ in range(self.gpus * self.world())])
        col.allgather_multigpu(everyone, self.tensors, group_name="multi")
        col.synchronize(0)
        return {"rank": self.rank, "gpus": self.gpus, "allreduce": summed,
                "allgather on GPU 0": [float(t[0]) for t in everyone[0]]}

    def world(self) -> int:
        return col.get_collective_group_size("multi")

    def teardown(self) -> None:
        col.destroy_collective_group("multi")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--actors", type=int, default=1)
    parser.add_argument("--gpus-per-actor", type=int, default=2)
    arguments = parser.parse_args()
    needed = arguments.actors * arguments.gpus_per_actor
    ray.init(logging_level="ERROR")
    if ray.cluster_resources().get("GPU", 0) < needed:
        print(f"this example needs {needed} GPUs in the Ray cluster; it has "
              f"{ray.cluster_resources().get('GPU', 0):g}")
        ray.shutdown()
        return 1
    worker = MultiGpuWorker.options(num_gpus=arguments.gpus_per_actor)
    workers = [worker.remote(rank) for rank in range(arguments.actors)]
    ray.get([w.setup.remote(arguments.actors) for w in workers])
    for result in ray.get([w.run.remote() for w in workers]):
        print(result)
    ray.get([w.teardown.remote() for w in workers])
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""JAX arrays in collectives: four Ray actors average and gather JAX arrays.

JAX's arrays are immutable, so the in-place calls (``col.allreduce(x, ...)``) refuse them and
say so; ``ray_collective.functional`` gives the form JAX code expects: each call returns a new
JAX array and leaves its input as it is. The arrays travel through DLPack without a copy into
the library (one copy out: the new array). Needs ``pip install 'jax[cpu]'``. Run it with
``python examples/jax_collectives.py``.
"""

import jax.numpy as jnp
import numpy as np
import ray

import ray_collective as col
from ray_collective import functional

WORLD_SIZE = 4


@ray.remote(num_cpus=0)
class Worker:
    def __init__(self, rank: int):
        self.rank = rank

    def setup(self, world_size: int) -> int:
        col.init_collective_group(world_size, self.rank, backend="ray", group_name="jax")
        return col.get_rank("jax")

    def step(self) -> dict:
        gradient = jnp.full((1000,), float(self.rank + 1), jnp.float32)
        try:
            col.allreduce(gradient, "jax")
            refused = "no"
        except col.ArgumentValueError:
            refused = "yes"
        mean = functional.allreduce(gradient, "jax", col.ReduceOp.AVG)
        ranks = functional.allgather(jnp.asarray([self.rank, 10 * self.rank]), "jax")
        return {"rank": self.rank, "in-place refused": refused,
                "mean gradient": float(mean[0]), "input unchanged": float(gradient[0]),
                "allgather": np.asarray(ranks).tolist(), "result type": type(mean).__name__}

    def teardown(self) -> None:
        col.destroy_collective_group("jax")


def main() -> None:
    ray.init(address="local", include_dashboard=False, logging_level="ERROR")
    workers = [Worker.remote(rank) for rank in range(WORLD_SIZE)]
    print("joined ranks:", ray.get([w.setup.remote(WORLD_SIZE) for w in workers]))
    for result in ray.get([w.step.remote() for w in workers]):
        print(result)
    ray.get([w.teardown.remote() for w in workers])
    print("every rank holds the average gradient 2.5 and every rank's pair, as new JAX arrays")
    ray.shutdown()


if __name__ == "__main__":
    main()

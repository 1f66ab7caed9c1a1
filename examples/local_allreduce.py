"""The collectives of ray_collective, run by four ranks inside this one process (no Ray needed).

Each rank is a thread that calls the library exactly as a Ray actor would. Run it with
``python examples/local_allreduce.py``.
"""

import numpy as np

import ray_collective as col
from ray_collective.testing import run_ranks

WORLD_SIZE = 4


def rank_body(rank: int) -> dict:
    """What one rank does: a few collectives on small numpy arrays."""
    gradient = np.full(3, float(rank + 1), dtype=np.float32)
    col.allreduce(gradient, op=col.ReduceOp.AVG)

    weights = np.arange(3, dtype=np.float64) if rank == 0 else np.zeros(3)
    col.broadcast(weights, src_rank=0)

    everyone = [np.zeros(1, np.int64) for _ in range(WORLD_SIZE)]
    col.allgather(everyone, np.array([rank * 10], np.int64))

    work = col.allreduce(np.ones(2, np.int32), async_op=True)
    work.wait()

    if rank == 0:
        col.send(np.array([42.0]), dst_rank=1, tag=7)
    elif rank == 1:
        message = np.zeros(1)
        col.recv(message, src_rank=0, tag=7)
        print(f"rank 1 received {message[0]:g} from rank 0")
    col.barrier()
    return {"average": gradient.tolist(), "weights": weights.tolist(),
            "allgather": [int(x[0]) for x in everyone]}


if __name__ == "__main__":
    for rank, result in enumerate(run_ranks(WORLD_SIZE, rank_body)):
        print(f"rank {rank}: {result}")

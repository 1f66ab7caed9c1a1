"""Declarative collectives on ObjectRefs: the driver specifies the whole allreduce in one call.

The two-actor example of the ``ray.util.collective`` design document: A and B each hold a buffer
and know nothing about collectives. The driver declares the group, then passes the refs of the
two buffers to ``allreduce_refs``, which returns at once with one result ref per rank; a second
call chained on those refs runs without the driver waiting in between. Run it with
``python examples/declarative_refs.py``.
"""

import numpy as np
import ray

import ray_collective as col


@ray.remote(num_cpus=0)
class Worker:
    def __init__(self, value: float):
        self.buffer = np.full(10, value, dtype=np.float32)

    def get_buffer(self) -> np.ndarray:
        return self.buffer


def main() -> None:
    ray.init(address="local", include_dashboard=False, logging_level="ERROR")
    a, b = Worker.remote(1.0), Worker.remote(2.0)
    col.declare_collective_group([a, b], world_size=2, ranks=[0, 1], backend="ray",
                                 group_name="refs")

    summed = col.allreduce_refs([a.get_buffer.remote(), b.get_buffer.remote()],
                                group_name="refs")
    maxed = col.allreduce_refs(summed, group_name="refs", op=col.ReduceOp.MAX)
    print("sum, rank 0:", ray.get(summed[0]))
    print("sum then max, rank 1:", ray.get(maxed[1]))

    received = col.send_ref(a.get_buffer.remote(), src_rank=0, dst_rank=1, group_name="refs")
    print("rank 1 received from rank 0:", ray.get(received))
    col.destroy_collective_group("refs")
    ray.shutdown()


if __name__ == "__main__":
    main()

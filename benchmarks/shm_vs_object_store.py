"""Moving a payload between two actors on one node: this library's shared memory vs Ray's
object store.

Both sides do the same work: the receiver ends with the payload copied into its own buffer.
- ``shm``: ``ray_collective.send`` / ``recv`` on the ``ray`` backend (payload copied once into
  the sender's shared-memory arena, copied out once by the receiver; a Unix-socket packet wakes
  it);
- ``object store``: the sender ``ray.put``s the payload and hands the reference to the receiver
  in an actor task, which ``ray.get``s it (a zero-copy read of the store) and copies it out.
Timed as a ping-pong (there and back), interleaved, median of the repetitions.

Run: ``python -m benchmarks.shm_vs_object_store [--bytes 8,65536,1048576,67108864]``.
"""

import argparse
import statistics
import time

import numpy as np
import ray

import ray_collective as col


@ray.remote(num_cpus=0)
class Endpoint:
    def __init__(self, rank: int):
        self.rank = rank
        self.peer = None
        self.buffer = np.empty(0, np.uint8)

    def setup(self, peer) -> None:
        self.peer = peer
        col.init_collective_group(2, self.rank, backend="ray", group_name="shm-vs-store")

    def shm_pingpong(self, nbytes: int, iterations: int) -> float:
        buffer = np.ones(nbytes, np.uint8)
        start = time.perf_counter()
        for _ in range(iterations):
            if self.rank == 0:
                col.send(buffer, 1, "shm-vs-store")
                col.recv(buffer, 1, "shm-vs-store")
            else:
                col.recv(buffer, 0, "shm-vs-store")
                col.send(buffer, 0, "shm-vs-store")
        return (time.perf_counter() - start) / iterations

    def take(self, refs) -> object:
        incoming = ray.get(refs[0])
        if self.buffer.shape != incoming.shape:
            self.buffer = np.empty_like(incoming)
        np.copyto(self.buffer, incoming)
        return ray.put(self.buffer)

    def store_pingpong(self, nbytes: int, iterations: int) -> float:
        self.buffer = np.ones(nbytes, np.uint8)
        start = time.perf_counter()
        for _ in range(iterations):
            reply = ray.get(self.peer.take.remote([ray.put(self.buffer)]))
            np.copyto(self.buffer, ray.get(reply))
        return (time.perf_counter() - start) / iterations


def main() -> None:
    """Print the median one-way time of each path per payload size, and their ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", default="8,65536,1048576,67108864")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    ray.init(address="local", include_dashboard=False, logging_level="ERROR")
    ends = [Endpoint.remote(0), Endpoint.remote(1)]
    ray.get([ends[0].setup.remote(ends[1]), ends[1].setup.remote(ends[0])])
    print(f"{'bytes':>10} {'shm one-way':>14} {'object store one-way':>22} {'store/shm':>10}")
    for nbytes in (int(b) for b in args.bytes.split(",")):
        iterations = max(2, min(200, (64 << 20) // max(nbytes, 1) // 4))
        shm, store = [], []
        for _ in range(args.repeats):
            shm.append(max(ray.get([e.shm_pingpong.remote(nbytes, iterations) for e in ends])))
            store.append(ray.get(ends[0].store_pingpong.remote(nbytes, iterations)))
        a, b = statistics.median(shm) / 2, statistics.median(store) / 2
        print(f"{nbytes:>10} {a * 1e6:>12.0f}us {b * 1e6:>20.0f}us {b / a:>10.1f}")
    ray.shutdown()


if __name__ == "__main__":
    main()

"""Point-to-point between two actors: a sender, a receiver, and tags to keep streams apart.

Run it with ``python examples/send_recv.py``.
"""

import numpy as np
import ray

import ray_collective as col


@ray.remote(num_cpus=0)
class Peer:
    def __init__(self, rank: int):
        self.rank = rank

    def run(self) -> str:
        col.init_collective_group(2, self.rank, backend="ray", group_name="pair")
        if self.rank == 0:
            col.send(np.arange(5, dtype=np.int64), dst_rank=1, group_name="pair", tag=1)
            col.send(np.full(3, 2.5), dst_rank=1, group_name="pair", tag=2)
            reply = np.zeros(1, np.int64)
            col.recv(reply, src_rank=1, group_name="pair")
            result = f"rank 0 got the reply {int(reply[0])}"
        else:
            halves = np.zeros(3)
            numbers = np.zeros(5, np.int64)
            col.recv(halves, src_rank=0, group_name="pair", tag=2)
            col.recv(numbers, src_rank=0, group_name="pair", tag=1)
            col.send(np.array([numbers.sum()]), dst_rank=0, group_name="pair")
            result = f"rank 1 got {numbers.tolist()} (tag 1) and {halves.tolist()} (tag 2)"
        col.destroy_collective_group("pair")
        return result


def main() -> None:
    ray.init(address="local", include_dashboard=False, logging_level="ERROR")
    peers = [Peer.remote(rank) for rank in range(2)]
    for line in ray.get([p.run.remote() for p in peers]):
        print(line)
    ray.shutdown()


if __name__ == "__main__":
    main()

"""A sync's plan run on the simulator: the bytes each node's link carries and the rounds, for
more subscribers than one machine holds.

Every bucket is one broadcast of its publisher's data group, so a sync is the simulator's
broadcasts of the plan's buckets (zero-memory mode: only sizes travel) over the members placed
on nodes: publisher p first on node p, the subscribers filling the nodes' other places in
order, ``ranks_per_node`` members to a node.

    python -m ray_collective.weight_sync.simulate --publishers 1 --subscribers 8,64,1024
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from ..sim.runner import simulate
from .layout import Layout, TensorSpec
from .plan import SyncPlan, make_plan


@dataclass(frozen=True)
class SyncSimulation:
    """What one simulated sync moved.

    Attributes:
        publishers, subscribers, ranks_per_node, nodes: the layout.
        model_bytes: the model's bytes.
        algorithms: the broadcast algorithm of each data group's buckets.
        node_bytes_sent, node_bytes_received: per node, over the whole sync, the bytes its
            link carried out and in.
        rounds: the most rounds any data group's buckets took, one after the other.
    """

    publishers: int
    subscribers: int
    ranks_per_node: int
    nodes: int
    model_bytes: int
    algorithms: Tuple[str, ...]
    node_bytes_sent: Tuple[int, ...]
    node_bytes_received: Tuple[int, ...]
    rounds: int

    @property
    def busiest_link(self) -> float:
        """The busiest node link's bytes (either way) over the model's: a node of subscribers
        must take the model in once, so 1.0 is the bound, whatever the number of subscribers."""
        return max(max(self.node_bytes_sent), max(self.node_bytes_received)) / self.model_bytes


def placement(publishers: int, subscribers: int, ranks_per_node: int) -> List[int]:
    """The node of each member in control order (publishers, then subscribers)."""
    members = publishers + subscribers
    nodes = max(publishers, -(-members // ranks_per_node))
    slots = [n for n in range(nodes) for _ in range(ranks_per_node)]
    for p in range(publishers):
        slots.remove(p)
    return list(range(publishers)) + slots[:subscribers]


def simulate_sync(plan: SyncPlan, subscribers: int, ranks_per_node: int = 8
                  ) -> SyncSimulation:
    """Run every bucket of ``plan`` to ``subscribers`` subscribers on the simulator.

    Args:
        plan: the sync's plan (its publishers are the plan's).
        subscribers: how many.
        ranks_per_node: members on one node.

    Returns:
        The :class:`SyncSimulation`.
    """
    publishers = 1 + max(b.owner for b in plan.buckets)
    node_of = placement(publishers, subscribers, ranks_per_node)
    nodes = max(node_of) + 1
    sent, received = [0] * nodes, [0] * nodes
    algorithms, rounds = [], []
    for p in range(publishers):
        group_nodes = [node_of[p]] + node_of[publishers:]
        group_rounds = 0
        for bucket in plan.buckets_of(p):
            report = simulate("broadcast", 1 + subscribers, bucket.nbytes, dtype="uint8",
                              check=False, node_of=group_nodes)
            group_rounds += report.rounds
            for n, (out, back) in enumerate(zip(report.node_bytes_sent,
                                                report.node_bytes_received)):
                sent[n] += out
                received[n] += back
            algorithm = report.algorithm
        algorithms.append(algorithm)
        rounds.append(group_rounds)
    return SyncSimulation(publishers, subscribers, ranks_per_node, nodes, plan.nbytes,
                          tuple(algorithms), tuple(sent), tuple(received), max(rounds))


def uniform_plan(model_bytes: int, tensors: int, publishers: int,
                 bucket_bytes: Optional[int] = None) -> SyncPlan:
    """The plan of a model of ``tensors`` equal tensors, replicated on ``publishers``."""
    size = model_bytes // tensors
    layout = Layout(tuple(TensorSpec(f"t{i:04d}", "uint8", (size,), size)
                          for i in range(tensors)))
    return make_plan([layout] * publishers, bucket_bytes)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ray_collective.weight_sync.simulate",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--publishers", default="1,2,4")
    parser.add_argument("--subscribers", default="8,64,1024")
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--model-mib", type=int, default=256)
    parser.add_argument("--tensors", type=int, default=64)
    options = parser.parse_args(argv)
    print("| publishers | subscribers | nodes | algorithm | busiest link / model | rounds |")
    print("|---|---|---|---|---|---|")
    for p in (int(x) for x in options.publishers.split(",")):
        plan = uniform_plan(options.model_mib << 20, options.tensors, p)
        for s in (int(x) for x in options.subscribers.split(",")):
            r = simulate_sync(plan, s, options.ranks_per_node)
            print(f"| {p} | {s} | {r.nodes} | {', '.join(sorted(set(r.algorithms)))} | "
                  f"{r.busiest_link:.2f} | {r.rounds} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Data-parallel training that survives a worker's death: the group shrinks, training goes on,
and a fresh actor takes the place back.

The task is the parameter-server example's (``examples/parameter_server``: scikit-learn's digits,
a thinc MLP, Adam), trained with its flat-allreduce scheme on a group declared from the driver:
every worker computes the gradient of its slice of each global batch into one flat buffer, one
``allreduce`` sums them, and every worker runs the same Adam step on the whole flat parameter
vector. The slices are weighted by their rows, so that whatever the number of workers the sum
is the gradient of the whole global batch: a run that loses a worker computes what an
undisturbed one does (up to the order of float additions).

The script trains 4 workers, kills one in the middle of a phase (SIGKILL from the driver),
shrinks the group from the driver (``shrink_collective_group``) and goes on with 3; then starts
a fresh actor and grows the group back to 4 (``grow_collective_group``). After each change the
new rank 0 broadcasts the training state (parameters, Adam's moments, the step) to every worker:
the step that failed is undefined in the survivors' buffers, and the new actor starts from
nothing. It prints each phase's mean loss and the held-out accuracy (the mean of the last ten
evaluations: one alone swings by two points on 360 test images) against an undisturbed run of
as many workers (their slices' gradients summed in one process). Needs the example's extras
(``pip install '.[example]'``)::

    python examples/elastic_training.py [--steps 150] [--workers 4]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import pathlib
import sys
import time
from typing import Dict, List, Optional

import numpy as np

REPOSITORY = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPOSITORY))

import ray_collective as col  # noqa: E402 - after the repository is importable
from examples.parameter_server.collective_variants import FlatBuffers  # noqa: E402
from examples.parameter_server.task import (BatchStream, TaskConfig, build_model,  # noqa: E402
                                            held_out_accuracy, load_digits,
                                            loss_and_gradients, make_optimizer)

GROUP = "elastic-training"
KEY = (-1, "flat")
"""Adam's key of the whole flat parameter vector (its moments live under it)."""
EVALUATE_EVERY = 5


class Replica:
    """One model and its optimizer on flat buffers, trained on its slice of each global batch;
    a worker actor holds one, and the driver one for the undisturbed reference."""

    def __init__(self, config: TaskConfig, global_batch: int):
        self.data = load_digits()
        self.model = build_model(config, self.data)
        self.optimizer = make_optimizer(config)
        self.buffers = FlatBuffers(self.model, 1, parameters_too=True)
        self.optimizer.mom1[KEY] = np.zeros_like(self.buffers.params)
        self.optimizer.mom2[KEY] = np.zeros_like(self.buffers.params)
        self.global_batch = global_batch
        self.batches = BatchStream(len(self.data.train_x), global_batch, config.seed)
        self.step = 0
        self.losses: Dict[int, float] = {}
        self.accuracy: Dict[int, float] = {}

    def gradient(self, rank: int, world_size: int) -> float:
        """This slice's gradient, weighted by its rows, in the flat buffer; its summed loss."""
        first = rank * self.global_batch // world_size
        last = (rank + 1) * self.global_batch // world_size
        rows = self.batches.rows(self.step, first, last - first)
        self.buffers.grads.fill(0)
        loss = loss_and_gradients(self.model, self.data.train_x[rows], self.data.train_y[rows])
        self.buffers.grads *= last - first
        return loss * (last - first)

    def update(self, loss_sum: float) -> None:
        """Adam on the flat vector, with the summed gradient of the whole global batch."""
        self.buffers.grads /= self.global_batch
        params, _ = self.optimizer(KEY, self.buffers.params, self.buffers.grads)
        if params is not self.buffers.params:
            self.buffers.params[:] = params
        self.losses[self.step] = loss_sum / self.global_batch
        self.step += 1
        if self.step % EVALUATE_EVERY == 0:
            self.accuracy[self.step] = held_out_accuracy(self.model, self.data)


class Worker:
    """A worker actor: its class knows nothing of the group (declared from the driver)."""

    def __init__(self, config: TaskConfig, global_batch: int):
        self.replica = Replica(config, global_batch)

    def pid(self) -> int:
        return os.getpid()

    def train(self, until: int) -> Optional[str]:
        """Train up to step ``until``; None, or the error that stopped it (a peer died)."""
        replica = self.replica
        while replica.step < until:
            loss = replica.gradient(col.get_rank(GROUP), col.get_collective_group_size(GROUP))
            total = np.array([loss])
            try:
                col.allreduce(replica.buffers.grads, GROUP)
                col.allreduce(total, GROUP)
            except col.CollectiveError as err:
                return type(err).__name__  # this step's buffers are undefined: redo it
            replica.update(float(total[0]))
        return None

    def synchronize(self) -> int:
        """Take rank 0's training state (parameters, Adam's moments, the step); the step."""
        replica, optimizer = self.replica, self.replica.optimizer
        counters = np.array([replica.step, optimizer.nr_update[KEY]], np.int64)
        for tensor in (replica.buffers.params, optimizer.mom1[KEY], optimizer.mom2[KEY],
                       counters):
            col.broadcast(tensor, 0, GROUP)
        replica.step, optimizer.nr_update[KEY] = int(counters[0]), int(counters[1])
        return replica.step

    def history(self) -> tuple:
        """(loss by step, accuracy by step, a digest of the parameters)."""
        replica = self.replica
        return (replica.losses, replica.accuracy,
                hashlib.sha256(replica.buffers.params.tobytes()).hexdigest())


def undisturbed(config: TaskConfig, global_batch: int, steps: int, workers: int) -> Replica:
    """The run without a failure: every step, the slices of ``workers`` summed in one process."""
    replica = Replica(config, global_batch)
    while replica.step < steps:
        total, loss = np.zeros_like(replica.buffers.grads), 0.0
        for rank in range(workers):
            loss += replica.gradient(rank, workers)
            total += replica.buffers.grads
        replica.buffers.grads[:] = total
        replica.update(loss)
    return replica


def last_mean(accuracy: Dict[int, float], count: int = 10) -> float:
    """The mean of the last ``count`` evaluations (one alone swings by two points)."""
    return float(np.mean([accuracy[step] for step in sorted(accuracy)[-count:]]))


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=150, help="updates (global batches)")
    parser.add_argument("--global-batch", type=int, default=128)
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--depth", type=int, default=8)
    args = parser.parse_args(argv)
    config = TaskConfig(width=args.width, depth=args.depth)
    phases = [args.steps * k // 3 for k in (1, 2, 3)]

    import ray
    path = os.pathsep.join(filter(None, [str(REPOSITORY), os.environ.get("PYTHONPATH", "")]))
    ray.init(address="local", include_dashboard=False, log_to_driver=False,
             logging_level="ERROR", runtime_env={"env_vars": {"PYTHONPATH": path}})
    worker = ray.remote(num_cpus=0)(Worker)
    workers = [worker.remote(config, args.global_batch) for _ in range(args.workers)]
    pids = ray.get([w.pid.remote() for w in workers])
    col.declare_collective_group(workers, group_name=GROUP)
    ray.get([w.train.remote(phases[0]) for w in workers])
    print(f"phase 1: {args.workers} workers trained to step {phases[0]}")

    # Phase 2: a worker dies in the middle of it.
    victim = args.workers // 2
    running = [w.train.remote(phases[1]) for w in workers]
    time.sleep(1.0)
    os.kill(pids[victim], 9)
    stopped = ray.get([ref for r, ref in enumerate(running) if r != victim])
    new_ranks = col.shrink_collective_group(GROUP)
    survivors = [workers[old] for old in sorted(new_ranks, key=new_ranks.get)]
    step = ray.get([w.synchronize.remote() for w in survivors])[0]
    print(f"phase 2: worker {victim} killed; the others stopped with "
          f"{sorted(set(map(str, stopped)))}; shrunk to ranks {new_ranks}; going on from step "
          f"{step}")
    ray.get([w.train.remote(phases[1]) for w in survivors])

    # Phase 3: a fresh actor takes the place back.
    fresh = worker.remote(config, args.global_batch)
    ray.get(fresh.pid.remote())
    grown = col.grow_collective_group(GROUP, actors=[fresh])
    members = survivors + [fresh]
    step = ray.get([w.synchronize.remote() for w in members])
    print(f"phase 3: a fresh actor joined; {grown} workers go on from step {step[0]} (its own "
          f"step: {step[-1]})")
    ray.get([w.train.remote(phases[2]) for w in members])

    histories = ray.get([w.history.remote() for w in members])
    col.destroy_collective_group(GROUP)
    losses, accuracy, _ = histories[0]
    reference = undisturbed(config, args.global_batch, args.steps, args.workers)
    ray.shutdown()
    bounds = [0] + phases
    for phase in range(3):
        steps = [s for s in losses if bounds[phase] <= s < bounds[phase + 1]]
        print(f"mean loss, phase {phase + 1}: {np.mean([losses[s] for s in steps]):.4f}")
    print(f"accuracy, elastic run: {last_mean(accuracy):.4f}")
    print(f"accuracy, undisturbed run: {last_mean(reference.accuracy):.4f}")
    print(f"the workers' parameters are identical: "
          f"{len({digest for _, _, digest in histories}) == 1}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

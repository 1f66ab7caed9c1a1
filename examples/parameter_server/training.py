"""Run one variant: N worker actors, each training on a thread, and what they measured.

``start_workers`` starts a pool of ``TrainingWorker`` actors (``num_cpus=0``, one process each);
``run_variant`` prepares the first ``workers`` of them for a run, lets them form their
communication (a collective group, or the parameter server's peer table), starts every training
thread and collects one ``WorkerReport`` per worker. The caller must have called ``ray.init``
with this repository importable by the workers.

Every worker runs its loop on a thread, as spacy-ray does, so that the actor's own thread is free
to serve the parameter server's incoming ``inc_grad`` / ``set_param`` calls; the driver waits
through a method in a separate concurrency group, which never blocks that serving thread.

Times: each worker records when its first step began and its last step ended on the machine's
monotonic clock (``time.monotonic``, one clock for every process of a Linux machine); the run's
time is the latest end minus the earliest start.
"""

from __future__ import annotations

import os
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ray_collective.integrations.thinc import communicators
from ray_collective.integrations.thinc.parameter_server import (PeerProxy, ServerCounters,
                                                                divide_keys)
from ray_collective.integrations.thinc.params import parameter_count, parameter_nodes

from . import collective_variants as cv
from .task import (BatchStream, Digits, TaskConfig, build_model, held_out_accuracy,
                   loss_and_gradients, make_optimizer)

CONTROL_GROUP = "control"
"""The actor's concurrency group for the driver's waiting call."""


@dataclass(frozen=True)
class Variant:
    """A way to train: the update scheme and the library that moves the bytes.

    Attributes:
        name: the CLI's name.
        scheme: ``local``, ``ps``, ``flat``, ``sharded`` or ``per_array``.
        library: ``actor-calls`` (the parameter server), ``ray_collective``,
            ``ray.util.collective-gloo``, ``torch.distributed-gloo``, or ``none``.
        synchronous: for ``ps``: wait for every worker's gradient (``grads_per_update = N``).
        summary: one line for tables.
    """

    name: str
    scheme: str
    library: str
    synchronous: bool
    summary: str


VARIANTS: Mapping[str, Variant] = {variant.name: variant for variant in (
    Variant("local", "local", "none", True, "one process, no communication"),
    Variant("ps-async", "ps", "actor-calls", False,
            "spacy-ray's sharded parameter server, asynchronous, grads_per_update=2"),
    Variant("ps-sync", "ps", "actor-calls", True,
            "the same server, synchronous: grads_per_update=N, wait for every worker"),
    Variant("allreduce-flat", "flat", "ray_collective", True,
            "one allreduce(AVG) of a flat gradient buffer, local optimizer"),
    Variant("rs-ag", "sharded", "ray_collective", True,
            "reducescatter(AVG), update of the own shard, allgather"),
    Variant("allreduce-per-array", "per_array", "ray_collective", True,
            "one allreduce(AVG) per gradient array (the design document's structure)"),
    Variant("gloo-allreduce-flat", "flat", "ray.util.collective-gloo", True,
            "allreduce-flat over ray.util.collective, backend=gloo"),
    Variant("gloo-rs-ag", "sharded", "ray.util.collective-gloo", True,
            "rs-ag over ray.util.collective, backend=gloo"),
    Variant("torch-allreduce-flat", "flat", "torch.distributed-gloo", True,
            "allreduce-flat over torch.distributed's own Gloo group"),
    Variant("torch-rs-ag", "sharded", "torch.distributed-gloo", True,
            "rs-ag over torch.distributed's own Gloo group"),
)}
"""Every variant, by name, in table order."""

PS_GRADS_PER_UPDATE = 2
"""spacy-ray's default: an owner updates an array after two gradients of it."""


@dataclass(frozen=True)
class RunOptions:
    """One run: a variant at a number of workers for a number of steps.

    Attributes:
        variant: a name of ``VARIANTS``.
        workers: worker actors (the world size).
        steps: updates each worker makes (global batches).
        task: the learning task.
        eval_every: rank 0 measures test accuracy every this many steps (0: only at the end).
        record_digests: every worker hashes its parameters after every step and returns its
            final parameters (tests only).
        backend: the ``ray_collective`` backend (``ray``; ``nccl`` with ``device="gpu"``).
        device: ``cpu``, or ``gpu`` (thinc on CuPy; never run on this project's machines).
        timeout_s: the longest any wait of the run may last.
    """

    variant: str
    workers: int
    steps: int
    task: TaskConfig = field(default_factory=TaskConfig)
    eval_every: int = 0
    record_digests: bool = False
    backend: str = "ray"
    device: str = "cpu"
    timeout_s: float = 900.0

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"unknown variant {self.variant!r}; choose from {sorted(VARIANTS)}")
        if self.variant == "local" and self.workers != 1:
            raise ValueError(f"the local variant runs one worker, not {self.workers}")
        if self.workers < 1 or self.steps < 1:
            raise ValueError(f"workers and steps must be >= 1, not {self.workers}, {self.steps}")


@dataclass
class WorkerReport:
    """What one worker measured.

    Attributes:
        rank: the worker.
        started: monotonic time at the first step's start.
        ended: monotonic time at the last step's end (after the final flush).
        losses: the mean cross-entropy of each step's batch on this worker.
        compute_seconds: training-thread time not spent communicating.
        communication_seconds: training-thread time spent in communication calls (and, for the
            synchronous server, waiting for peers).
        serve_seconds: actor-thread time serving peers' calls (parameter server only).
        bus_bytes: bytes sent by this rank's collective algorithms (their formula).
        actor_calls: Ray actor calls made by the training code.
        bytes_sent: array bytes passed to those calls.
        grads_accepted, grads_dropped: parameter server: gradients used and dropped as stale.
        updates_per_key: parameter server: optimizer runs of each owned array.
        accuracy_curve: rank 0: ``(step, seconds since start, test accuracy)``.
        final_accuracy: rank 0: test accuracy after the last step.
        digests: per-step parameter hashes (``record_digests``).
        final_digest: the parameters' hash after the run.
        final_parameters: every parameter after the run, in walk order (``record_digests``).
        parameters: the number of parameters of the model.
    """

    rank: int
    started: float = 0.0
    ended: float = 0.0
    losses: List[float] = field(default_factory=list)
    compute_seconds: float = 0.0
    communication_seconds: float = 0.0
    serve_seconds: float = 0.0
    bus_bytes: int = 0
    actor_calls: int = 0
    bytes_sent: int = 0
    grads_accepted: int = 0
    grads_dropped: int = 0
    updates_per_key: Dict[str, int] = field(default_factory=dict)
    accuracy_curve: List[Tuple[int, float, float]] = field(default_factory=list)
    final_accuracy: Optional[float] = None
    digests: List[str] = field(default_factory=list)
    final_digest: str = ""
    final_parameters: Optional[Any] = None
    parameters: int = 0


class ParameterServerTrainer(cv.Trainer):
    """The parameter server's side of a step: thinc's hooks do the talking (``PeerProxy``)."""

    def __init__(self, model: Any, optimizer: Any, proxy: PeerProxy) -> None:
        super().__init__(model, optimizer)
        self.proxy = proxy
        self._next_step = 0

    def step(self, step: int, x: Any, y: Any) -> float:
        self.proxy.begin_step(step)
        self._next_step = step + 1
        return loss_and_gradients(self.model, x, y)

    def before_reading(self, steps_done: int) -> None:
        """A synchronous proxy's reads then wait for the update of step ``steps_done - 1``."""
        self.proxy.begin_step(steps_done)

    def finish(self) -> None:
        """Read every array once more: owners apply the last step's gradients and send them."""
        self.proxy.begin_step(self._next_step)
        for _, node in parameter_nodes(self.model):
            for name in node.param_names:
                node.get_param(name)


class TrainingWorker:
    """One worker (a Ray actor): prepares a run, joins its peers, trains on a thread.

    One actor can serve several runs one after the other (``prepare`` starts afresh), which
    spares the seconds each new process spends importing thinc.
    """

    def __init__(self) -> None:
        self._rank = 0
        self._options: Optional[RunOptions] = None
        self._proxy: Optional[PeerProxy] = None
        self._communicator: Optional[communicators.Communicator] = None

    def prepare(self, rank: int, options: RunOptions, data: Digits) -> int:
        """Build the model and optimizer of a run from scratch.

        Args:
            rank: this worker's rank in the run.
            options: the run.
            data: the split digits (the driver loads them once).

        Returns:
            This actor's process id.
        """
        self._rank = rank
        self._options = options
        self._variant = VARIANTS[options.variant]
        if options.device == "gpu":
            from thinc.api import require_gpu
            require_gpu(0)
        self._data = data
        self._model = build_model(options.task, data)
        self._optimizer = make_optimizer(options.task)
        self._trainer: Optional[cv.Trainer] = None
        self._communicator = None
        self._proxy = None
        self._thread: Optional[threading.Thread] = None
        self._report = WorkerReport(rank=rank, parameters=parameter_count(self._model))
        self._error: Optional[str] = None
        self._peers: List[Any] = []
        return os.getpid()

    def join(self, peers: List[Any], rendezvous: str) -> None:
        """Form this worker's communication; collective groups return once all have joined.

        Args:
            peers: every worker's actor handle, by rank (the parameter server's peer table).
            rendezvous: the group's name, or torch's ``tcp://host:port`` init method.
        """
        scheme, library, world = self._variant.scheme, self._variant.library, len(peers)
        self._peers = peers
        if scheme == "local":
            self._trainer = cv.LocalTrainer(self._model, self._optimizer)
            return
        if scheme == "ps":
            grads_per_update = world if self._variant.synchronous else PS_GRADS_PER_UPDATE
            self._proxy = PeerProxy(self._model, self._rank, peers,
                                    divide_keys(self._model, world), self._optimizer,
                                    grads_per_update, self._variant.synchronous,
                                    self._options.timeout_s)
            self._proxy.install(self._model)
            self._trainer = ParameterServerTrainer(self._model, self._optimizer, self._proxy)
            return
        if library == "ray_collective":
            self._communicator = communicators.RayCollectiveCommunicator(
                world, self._rank, rendezvous, self._options.backend, self._options.timeout_s)
        elif library == "ray.util.collective-gloo":
            self._communicator = communicators.RayUtilGlooCommunicator(
                world, self._rank, rendezvous, self._options.timeout_s)
        else:
            self._communicator = communicators.TorchGlooCommunicator(
                world, self._rank, rendezvous, self._options.timeout_s)
        trainer_class = {"flat": cv.FlatAllreduce, "sharded": cv.ShardedUpdate,
                         "per_array": cv.PerArrayAllreduce}[scheme]
        self._trainer = trainer_class(self._model, self._optimizer, self._communicator)

    def start(self) -> None:
        """Start the training thread and return at once."""
        self._thread = threading.Thread(target=self._train_guarded, name="training",
                                        daemon=True)
        self._thread.start()

    def result(self) -> dict:
        """Wait for the training thread (call in the ``control`` concurrency group).

        Returns:
            The ``WorkerReport`` as a dict.

        Raises:
            RuntimeError: the training thread failed (its traceback in the message).
        """
        self._thread.join()
        if self._error is not None:
            raise RuntimeError(f"rank {self._rank} of {self._options.variant}: {self._error}")
        if self._proxy is not None:
            self._drain()
        return asdict(self._report)

    def close(self) -> None:
        """Leave the collective group, if any."""
        if self._communicator is not None:
            self._communicator.close()
            self._communicator = None

    # spacy-ray's peer methods: the names its proxies call on one another.

    def inc_grad(self, key: Tuple[int, str], version: int, value: Any) -> None:
        """A peer's gradient of an array this worker owns (served on the actor's thread)."""
        self._proxy.receive_grad(tuple(key), version, value)

    def set_param(self, key: Tuple[int, str], version: int, value: Any) -> None:
        """An owner's new value of an array (served on the actor's thread)."""
        self._proxy.receive_param(tuple(key), version, value)

    def peer_done(self, calls_sent_to_us: int) -> None:
        """A peer's training is over; it made ``calls_sent_to_us`` calls to this worker."""
        self._proxy.peer_finished(calls_sent_to_us)

    def _drain(self) -> None:
        """Parameter server: tell each peer how many calls it must serve, then serve ours."""
        for index, peer in enumerate(self._peers):
            if index != self._rank:
                peer.peer_done.remote(self._proxy.calls_sent_to(index))
        self._proxy.wait_drained(self._options.timeout_s)
        self._collect(self._report.ended - self._report.started)

    def _train_guarded(self) -> None:
        try:
            self._train()
        except Exception:  # reported to the driver by result()
            self._error = traceback.format_exc()

    def _train(self) -> None:
        options, report, trainer = self._options, self._report, self._trainer
        task, data, ops = options.task, self._data, self._model.ops
        batch = task.per_worker_batch
        stream = BatchStream(len(data.train_x), batch * options.workers, task.seed)
        first = self._rank * batch
        evaluation_seconds = 0.0
        report.started = time.monotonic()
        for step in range(options.steps):
            rows = stream.rows(step, first, batch)
            report.losses.append(trainer.step(step, ops.asarray(data.train_x[rows]),
                                              ops.asarray(data.train_y[rows])))
            if options.record_digests:
                report.digests.append(trainer.digest())
            if self._rank == 0 and options.eval_every and (step + 1) % options.eval_every == 0:
                evaluated = time.monotonic()
                trainer.before_reading(step + 1)
                accuracy = held_out_accuracy(self._model, data)
                report.accuracy_curve.append(
                    (step + 1, evaluated - report.started - evaluation_seconds, accuracy))
                evaluation_seconds += time.monotonic() - evaluated
        trainer.finish()
        report.ended = time.monotonic() - evaluation_seconds
        elapsed = report.ended - report.started
        self._collect(elapsed)
        if self._rank == 0:
            report.final_accuracy = held_out_accuracy(self._model, data)
        report.final_digest = trainer.digest()
        if options.record_digests:
            report.final_parameters = trainer.parameters()

    def _collect(self, elapsed: float) -> None:
        report = self._report
        communication = self._trainer.clock.communication_seconds
        if self._communicator is not None:
            report.bus_bytes = self._communicator.bus_bytes
        if self._proxy is not None:
            counters: ServerCounters = self._proxy.counters
            communication += counters.send_seconds + counters.wait_seconds
            report.serve_seconds = counters.serve_seconds
            report.actor_calls, report.bytes_sent = counters.actor_calls, counters.bytes_sent
            report.grads_accepted = counters.grads_accepted
            report.grads_dropped = counters.grads_dropped
            report.updates_per_key = {f"{position}/{name}": count
                                      for (position, name), count in counters.updates.items()}
        report.communication_seconds = communication
        report.compute_seconds = max(0.0, elapsed - communication)


@dataclass(frozen=True)
class RunResult:
    """A run's outcome: the options and every worker's report (by rank)."""

    options: RunOptions
    reports: List[WorkerReport]

    @property
    def seconds(self) -> float:
        """The run's time: from the earliest first step to the latest last step."""
        return max(r.ended for r in self.reports) - min(r.started for r in self.reports)


def _rendezvous(options: RunOptions, ray: Any, serial: int) -> str:
    """The group's name, or for torch a ``tcp://`` address on the driver's node.

    torch's rank 0 hosts the TCP store there: on one machine, as every run of this example.

    ``ray.util.collective``'s Gloo group is named ``default``: only that group's destruction
    also destroys torch's default process group, which the next run (perhaps of another world
    size) needs gone. This library's groups get fresh names.
    """
    library = VARIANTS[options.variant].library
    if library == "ray.util.collective-gloo":
        return "default"
    if library == "torch.distributed-gloo":
        import socket
        address = ray.util.get_node_ip_address()
        with socket.socket() as probe:
            probe.bind((address, 0))
            port = probe.getsockname()[1]
        return f"tcp://{address}:{port}"
    return f"ps-example-{options.variant}-{serial}-{time.monotonic_ns()}"


def start_workers(count: int) -> List[Any]:
    """``count`` idle worker actors (``num_cpus=0``: many share the machine's cores).

    Args:
        count: how many.

    Returns:
        Their handles; ``run_variant`` uses the first ``workers`` of them.
    """
    import ray
    worker_class = ray.remote(num_cpus=0, concurrency_groups={CONTROL_GROUP: 1})(TrainingWorker)
    return [worker_class.remote() for _ in range(count)]


def run_variant(options: RunOptions, data: Any, pool: List[Any], serial: int = 0) -> RunResult:
    """Run one variant to the end on the first ``options.workers`` actors of ``pool``.

    Args:
        options: the run.
        data: ``load_digits()``, or an ObjectRef of it.
        pool: actors from ``start_workers``; a failed run can leave them unusable.
        serial: a number that keeps this run's group names apart from other runs'.

    Returns:
        The workers' reports.

    Raises:
        ValueError: the pool is smaller than the run.
        RuntimeError: a worker failed (the message names it and carries its traceback).
        ray.exceptions.GetTimeoutError: a phase took longer than ``options.timeout_s``.
    """
    import ray
    if len(pool) < options.workers:
        raise ValueError(f"{options.workers} workers asked for, the pool has {len(pool)}")
    workers = pool[:options.workers]
    timeout = options.timeout_s
    ray.get([w.prepare.remote(rank, options, data) for rank, w in enumerate(workers)],
            timeout=timeout)
    rendezvous = _rendezvous(options, ray, serial)
    ray.get([w.join.remote(workers, rendezvous) for w in workers], timeout=timeout)
    ray.get([w.start.remote() for w in workers], timeout=timeout)
    results = ray.get([w.result.options(concurrency_group=CONTROL_GROUP).remote()
                       for w in workers], timeout=timeout)
    ray.get([w.close.remote() for w in workers], timeout=timeout)
    return RunResult(options, [WorkerReport(**result) for result in results])

"""Agent/observer benchmark, modelled on PyTorch's distributed-RPC reinforcement-learning benchmark.

One agent and N observers, every one a Ray actor (``num_cpus=0``). In each iteration every
observer sends its state (``--state-size`` float32 values) to the agent and waits for an action;
the agent runs a small torch policy (state → 128 hidden → ``--actions`` logits, action = argmax).

World size counts the ranks of the collective group: 1 agent (rank 0) and ``world_size - 1``
observers. The driver plays PyTorch's coordinator and is not a rank; PyTorch's benchmark gives
its coordinator a rank too (its observers are ranks ``2 .. world_size - 1``), so our world size
W corresponds to PyTorch's W + 1.

Backends:

- ``ray``: this library's ``ray`` backend. ``--batch false``: each observer ``send``s its state
  to the agent and ``recv``s its action; the agent serves observers 1..N in order (``recv``
  state, policy on that one state, ``send`` action). ``--batch true``: the agent ``gather``s
  all states, runs the policy once on the batch, and ``scatter``s the actions.
- ``ray-actors``: the same workload over plain Ray actor calls. Each observer calls
  ``agent.select_action.remote(iteration, state)`` and ``ray.get``s the action. The agent is an
  async actor: without batching it runs the policy on each request as it comes; with batching
  it holds the requests of an iteration until all N have arrived, runs the policy once and
  answers them all (like the reference's batch mode).
- ``torch-rpc``: ``torch.distributed.rpc`` (TensorPipe) as PyTorch's benchmark drives it, in
  the same rank actors (``agent_observer_rpc``): each observer ``rpc_sync``s its state to the
  agent's ``RRef``; with batching the agent's function returns a future completed for all
  observers of an iteration after one policy call.

Metrics (each at p50/p75/p90/p95):

- agent latency: the agent's iteration period — from the end of its previous iteration (its
  last action sent) to the last action of this iteration sent; so it includes waiting for the
  states. PyTorch starts the clock at the first request's arrival, which a ``gather`` cannot
  see; the period is measured the same way for every backend and mode.
- agent throughput: requests served per second in an iteration, N / agent latency.
- observer latency: from an observer starting to send its state to its action received.
- observer throughput: 1 / observer latency.

Run ``python -m benchmarks.agent_observer --help`` for the options.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .cli import at_least, choice, comma_list, non_negative_int, positive_int

BACKENDS = ("ray", "ray-actors", "torch-rpc")
PERCENTILES = (50, 75, 90, 95)
HIDDEN_UNITS = 128
METRICS = ("agent_latency_s", "agent_throughput_rps", "observer_latency_s",
           "observer_throughput_rps")


@dataclass(frozen=True)
class AgentObserverOptions:
    """What one run of the benchmark measures.

    Attributes:
        world_sizes: ranks per point: 1 agent plus world_size - 1 observers (each >= 2).
        batch_modes: False (one request at a time) and/or True (one policy call per iteration).
        backends: names from ``BACKENDS``.
        iterations: timed iterations per point.
        warmup: untimed iterations before them.
        state_size: float32 values in one observer's state.
        actions: the policy's number of actions (its output width).
        seed: seed of the policy's weights and of the observers' states.
        timeout_s: deadline of any one wait: a collective call, an actor start, a whole point.
        record_iterations: how many first timed iterations' states and actions every observer
            returns, so callers can check the actions against the policy.
    """

    world_sizes: Tuple[int, ...] = (2, 4, 8, 16)
    batch_modes: Tuple[bool, ...] = (True, False)
    backends: Tuple[str, ...] = BACKENDS
    iterations: int = 100
    warmup: int = 10
    state_size: int = 4
    actions: int = 2
    seed: int = 0
    timeout_s: float = 120.0
    record_iterations: int = 0


@dataclass(frozen=True)
class ObserverRecord:
    """What one observer did: its latencies and the first recorded states and actions.

    Attributes:
        latencies_s: one per timed iteration.
        states: ``record_iterations`` states, shape (k, state_size).
        actions: the actions it received for them, shape (k,).
    """

    latencies_s: Tuple[float, ...]
    states: np.ndarray
    actions: np.ndarray


@dataclass(frozen=True)
class PointResult:
    """One (backend, batch mode, world size) point.

    Attributes:
        backend, batch, world_size: the point; observers = world_size - 1.
        iterations: timed iterations.
        metrics: ``{metric: {"p50": ..., "p75": ..., "p90": ..., "p95": ...}}`` for ``METRICS``.
        agent_periods_s: the agent's iteration periods (the agent latency samples).
        observers: one record per observer, rank order.
        error: why the point failed, or None.
    """

    backend: str
    batch: bool
    world_size: int
    iterations: int
    metrics: Dict[str, Dict[str, float]]
    agent_periods_s: Tuple[float, ...]
    observers: Tuple[ObserverRecord, ...]
    error: Optional[str] = None


def make_policy(state_size: int, actions: int, seed: int):
    """The agent's policy: a 2-layer MLP with weights fixed by ``seed`` (same in every process).

    Args:
        state_size: input width.
        actions: output width.
        seed: seed of the weights.

    Returns:
        A ``torch.nn.Module`` in eval mode.
    """
    import torch
    generator = torch.Generator().manual_seed(seed)
    policy = torch.nn.Sequential(torch.nn.Linear(state_size, HIDDEN_UNITS), torch.nn.ReLU(),
                                 torch.nn.Linear(HIDDEN_UNITS, actions))
    with torch.no_grad():
        for parameter in policy.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    return policy.eval()


def select_actions(policy, states: np.ndarray) -> np.ndarray:
    """The policy's greedy actions for a batch of states.

    Args:
        policy: from :func:`make_policy`.
        states: float32 array of shape (batch, state_size).

    Returns:
        int64 array of shape (batch,): the argmax of each row's logits.
    """
    import torch
    with torch.no_grad():
        logits = policy(torch.from_numpy(np.ascontiguousarray(states, dtype=np.float32)))
    return logits.argmax(dim=1).numpy().astype(np.int64)


def observer_state(seed: int, rank: int, iteration: int, state_size: int) -> np.ndarray:
    """Observer ``rank``'s state in ``iteration``: deterministic, so tests can recompute it."""
    rng = np.random.default_rng((seed, rank, iteration))
    return rng.standard_normal(state_size).astype(np.float32)


def _limit_torch_threads() -> None:
    # Two cores shared by up to dozens of processes: torch's own thread pool would only contend.
    import torch
    torch.set_num_threads(1)


class BenchmarkRank:
    """A rank of the ``ray`` backend (agent or observer); also an observer of ``ray-actors``."""

    def __init__(self, rank: int):
        self.rank = rank

    def ready(self) -> int:
        return self.rank

    def join(self, world_size: int, group_name: str, timeout_s: float) -> None:
        import ray_collective as col
        col.init_collective_group(world_size, self.rank, backend="ray", group_name=group_name,
                                  timeout=timeout_s)

    def leave(self, group_name: str) -> None:
        import ray_collective as col
        col.destroy_collective_group(group_name)

    def serve(self, options: AgentObserverOptions, group_name: str, world_size: int,
              batch: bool) -> List[float]:
        """Agent (rank 0) of the ``ray`` backend: serve every iteration; return the periods."""
        import ray_collective as col
        _limit_torch_threads()
        policy = make_policy(options.state_size, options.actions, options.seed)
        timeout = options.timeout_s
        observers = range(1, world_size)
        states = [np.zeros(options.state_size, np.float32) for _ in range(world_size)]
        action_slots = [np.zeros(1, np.int64) for _ in range(world_size)]
        state = np.zeros(options.state_size, np.float32)
        own_action = np.zeros(1, np.int64)
        periods: List[float] = []
        previous_end = time.perf_counter()
        for iteration in range(options.warmup + options.iterations):
            if batch:
                col.gather(states, state, dst_rank=0, group_name=group_name, timeout=timeout)
                chosen = select_actions(policy, np.stack(states[1:]))
                for observer, action in zip(observers, chosen):
                    action_slots[observer][0] = action
                col.scatter(own_action, action_slots, src_rank=0, group_name=group_name,
                            timeout=timeout)
            else:
                for observer in observers:
                    col.recv(state, observer, group_name=group_name, timeout=timeout)
                    action_slots[observer][0] = select_actions(policy, state[None, :])[0]
                    col.send(action_slots[observer], observer, group_name=group_name,
                             timeout=timeout)
            end = time.perf_counter()
            if iteration >= options.warmup:
                periods.append(end - previous_end)
            previous_end = end
        return periods

    def observe(self, options: AgentObserverOptions, group_name: str,
                batch: bool) -> ObserverRecord:
        """Observer of the ``ray`` backend: send states, wait for actions, time each."""
        import ray_collective as col
        timeout = options.timeout_s
        action = np.zeros(1, np.int64)

        def request(state: np.ndarray, _iteration: int) -> int:
            if batch:
                col.gather(None, state, dst_rank=0, group_name=group_name, timeout=timeout)
                col.scatter(action, None, src_rank=0, group_name=group_name, timeout=timeout)
            else:
                col.send(state, 0, group_name=group_name, timeout=timeout)
                col.recv(action, 0, group_name=group_name, timeout=timeout)
            return int(action[0])

        return observe_loop(options, self.rank, request)

    def rpc_join(self, world_size: int, init_method: str, timeout_s: float) -> str:
        """Join the ``torch-rpc`` world (``agent_observer_rpc.join``); returns torch's version."""
        from benchmarks import agent_observer_rpc
        return agent_observer_rpc.join(self.rank, world_size, init_method, timeout_s)

    def rpc_coordinate(self, options: AgentObserverOptions, world_size: int,
                       batch: bool) -> Tuple[List[float], List[ObserverRecord]]:
        """Agent (rank 0) of ``torch-rpc``: run one point (``agent_observer_rpc.coordinate``)."""
        from benchmarks import agent_observer_rpc
        return agent_observer_rpc.coordinate(options, world_size, batch)

    def rpc_leave(self) -> None:
        """Leave the ``torch-rpc`` world (every rank at once)."""
        from benchmarks import agent_observer_rpc
        agent_observer_rpc.leave()

    def observe_actor(self, options: AgentObserverOptions, agent) -> ObserverRecord:
        """Observer of the ``ray-actors`` backend: one actor call per request."""
        import ray

        def request(state: np.ndarray, iteration: int) -> int:
            return ray.get(agent.select_action.remote(iteration, state),
                           timeout=options.timeout_s)

        return observe_loop(options, self.rank, request)


def observe_loop(options: AgentObserverOptions, rank: int, request) -> ObserverRecord:
    """An observer's iterations, whatever carries its requests: each state sent, timed until
    its action is back.

    Args:
        options: the run's options (iterations, warm-up, seed, state size, records kept).
        rank: the observer's rank (its states depend on it).
        request: ``request(state, iteration)`` sends one state and returns the action.

    Returns:
        The observer's latencies and its first recorded states and actions.
    """
    latencies: List[float] = []
    states: List[np.ndarray] = []
    actions: List[int] = []
    for iteration in range(options.warmup + options.iterations):
        state = observer_state(options.seed, rank, iteration, options.state_size)
        started = time.perf_counter()
        action = request(state, iteration)
        elapsed = time.perf_counter() - started
        timed_index = iteration - options.warmup
        if timed_index >= 0:
            latencies.append(elapsed)
            if timed_index < options.record_iterations:
                states.append(state)
                actions.append(action)
    return ObserverRecord(tuple(latencies),
                          np.array(states, np.float32).reshape(-1, options.state_size),
                          np.array(actions, np.int64))


class AgentState:
    """An agent's policy and bookkeeping, whatever carries its requests: the requests pending
    per iteration (batching), how many of each iteration it served, and when each iteration's
    last action went out (the agent latency's periods)."""

    def __init__(self, options: AgentObserverOptions, observers: int, batch: bool):
        _limit_torch_threads()
        self.policy = make_policy(options.state_size, options.actions, options.seed)
        self.observers = observers
        self.batch = batch
        self.warmup = options.warmup
        self.timeout_s = options.timeout_s
        self.pending: Dict[int, List[Tuple[np.ndarray, Any]]] = {}
        self.served: Dict[int, int] = {}
        self.iteration_ends: Dict[int, float] = {}
        self.started = time.perf_counter()

    def count_served(self, iteration: int, count: int) -> None:
        """Count ``count`` more requests of ``iteration`` answered; the last one ends it."""
        self.served[iteration] = self.served.get(iteration, 0) + count
        if self.served[iteration] == self.observers:
            self.iteration_ends[iteration] = time.perf_counter()

    def periods(self) -> List[float]:
        """The iteration periods of the timed iterations (see the module's agent latency)."""
        ends = [self.iteration_ends[k] for k in sorted(self.iteration_ends)]
        starts = [self.started] + ends[:-1]
        return [end - start for start, end in zip(starts, ends)][self.warmup:]


class ActorAgent(AgentState):
    """The agent of the ``ray-actors`` backend: an async actor answering ``select_action``."""

    async def select_action(self, iteration: int, state: np.ndarray) -> int:
        if not self.batch:
            action = int(select_actions(self.policy, state[None, :])[0])
            self.count_served(iteration, 1)
            return action
        future = asyncio.get_running_loop().create_future()
        waiting = self.pending.setdefault(iteration, [])
        waiting.append((state, future))
        if len(waiting) == self.observers:
            del self.pending[iteration]
            chosen = select_actions(self.policy, np.stack([s for s, _ in waiting]))
            for (_, waiter), action in zip(waiting, chosen):
                waiter.set_result(int(action))
            self.count_served(iteration, len(waiting))
        # An observer that never asks would hold the others' requests: bound the wait.
        return await asyncio.wait_for(future, self.timeout_s)


def summarize(periods: Sequence[float], observers: Sequence[ObserverRecord],
              batch_size: int) -> Dict[str, Dict[str, float]]:
    """The four metrics at ``PERCENTILES`` from the raw samples.

    Args:
        periods: the agent's iteration periods, seconds.
        observers: every observer's record.
        batch_size: requests the agent serves per iteration (the number of observers).

    Returns:
        ``{metric: {"p50": ..., ...}}`` for every name in ``METRICS``.

    Raises:
        ValueError: no samples, or a non-positive one.
    """
    observer_latencies = np.array([t for o in observers for t in o.latencies_s], float)
    agent_latencies = np.array(periods, float)
    if agent_latencies.size == 0 or observer_latencies.size == 0:
        raise ValueError("no samples to summarize")
    if (agent_latencies <= 0).any() or (observer_latencies <= 0).any():
        raise ValueError("latencies must be positive")
    samples = {"agent_latency_s": agent_latencies,
               "agent_throughput_rps": batch_size / agent_latencies,
               "observer_latency_s": observer_latencies,
               "observer_throughput_rps": 1.0 / observer_latencies}
    return {name: {f"p{q}": float(v) for q, v in zip(PERCENTILES, np.percentile(values, PERCENTILES))}
            for name, values in samples.items()}


def _kill_all(ray, actors) -> None:
    for actor in actors:
        try:
            ray.kill(actor)
        except Exception:  # noqa: BLE001 - an actor that is already gone needs no killing
            pass


def _run_ray_point(ray, ranks, options: AgentObserverOptions, world_size: int,
                   batch: bool, group_name: str) -> Tuple[List[float], List[ObserverRecord]]:
    deadline = options.timeout_s + 10.0
    serve = ranks[0].serve.remote(options, group_name, world_size, batch)
    observed = [rank.observe.remote(options, group_name, batch) for rank in ranks[1:]]
    periods = ray.get(serve, timeout=_point_timeout(options) + deadline)
    return periods, ray.get(observed, timeout=deadline)


def _run_actor_point(ray, ranks, options: AgentObserverOptions, world_size: int,
                     batch: bool) -> Tuple[List[float], List[ObserverRecord]]:
    # Enough concurrency that every observer's request of an iteration can wait at once.
    agent_class = ray.remote(num_cpus=0, max_concurrency=max(2, world_size))(ActorAgent)
    agent = agent_class.remote(options, world_size - 1, batch)
    try:
        observed = [rank.observe_actor.remote(options, agent) for rank in ranks[1:]]
        records = ray.get(observed, timeout=_point_timeout(options) + options.timeout_s)
        return ray.get(agent.periods.remote(), timeout=options.timeout_s), records
    finally:
        _kill_all(ray, [agent])


def _point_timeout(options: AgentObserverOptions) -> float:
    # A point is many calls; each call has its own deadline, the whole gets a generous one.
    return options.timeout_s * 2


def run_benchmark(options: AgentObserverOptions) -> List[PointResult]:
    """Measure every (world size, backend, batch mode) point on an already initialized Ray.

    Args:
        options: what to measure.

    Returns:
        One :class:`PointResult` per point, in sweep order; a failed point carries ``error``.

    Raises:
        RuntimeError: Ray is not initialized.
    """
    import ray
    if not ray.is_initialized():
        raise RuntimeError("run_benchmark needs ray.init() first (main() does it)")
    rank_class = ray.remote(num_cpus=0)(BenchmarkRank)
    results: List[PointResult] = []
    for world_size in options.world_sizes:
        ranks = [rank_class.remote(rank) for rank in range(world_size)]
        try:
            ray.get([r.ready.remote() for r in ranks], timeout=options.timeout_s)
            group_name = None
            if "ray" in options.backends:
                group_name = f"agent-observer-{world_size}-{uuid.uuid4().hex[:8]}"
                ray.get([r.join.remote(world_size, group_name, options.timeout_s) for r in ranks],
                        timeout=options.timeout_s + 10.0)
            if "torch-rpc" in options.backends:
                from .peers import store_address
                address = store_address()
                ray.get([r.rpc_join.remote(world_size, address, options.timeout_s)
                         for r in ranks], timeout=options.timeout_s + 10.0)
            for backend in options.backends:
                for batch in options.batch_modes:
                    results.append(_measure_point(ray, ranks, options, backend, world_size,
                                                  batch, group_name))
            if group_name is not None:
                ray.get([r.leave.remote(group_name) for r in ranks], timeout=options.timeout_s)
            if "torch-rpc" in options.backends:
                ray.get([r.rpc_leave.remote() for r in ranks], timeout=options.timeout_s)
        except Exception as exc:  # noqa: BLE001 - report the world size as failed, go on
            done = {(r.backend, r.batch) for r in results if r.world_size == world_size}
            for backend in options.backends:
                for batch in options.batch_modes:
                    if (backend, batch) not in done:
                        results.append(PointResult(backend, batch, world_size, 0, {}, (), (),
                                                   f"{type(exc).__name__}: {exc}"))
        finally:
            _kill_all(ray, ranks)
    return results


def _measure_point(ray, ranks, options: AgentObserverOptions, backend: str, world_size: int,
                   batch: bool, group_name: Optional[str]) -> PointResult:
    if backend == "ray":
        periods, records = _run_ray_point(ray, ranks, options, world_size, batch, group_name)
    elif backend == "torch-rpc":
        periods, records = ray.get(ranks[0].rpc_coordinate.remote(options, world_size, batch),
                                   timeout=_point_timeout(options) + options.timeout_s)
    else:
        periods, records = _run_actor_point(ray, ranks, options, world_size, batch)
    metrics = summarize(periods, records, batch_size=world_size - 1)
    return PointResult(backend, batch, world_size, options.iterations, metrics, tuple(periods),
                       tuple(records))


# ---------------------------------------------------------------- command line

def _boolean(text: str) -> bool:
    words = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
    if text.lower() not in words:
        raise ValueError(f"expected true or false, not {text!r}")
    return words[text.lower()]


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser of ``python -m benchmarks.agent_observer``."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.agent_observer",
        description="One agent and N observers: states in, actions out, per iteration; "
                    "this library's send/recv or gather/scatter against plain Ray actor calls "
                    "and torch.distributed.rpc.")
    parser.add_argument("--world-size", type=comma_list(at_least(2)), default=(2, 4, 8, 16),
                        help="comma-separated ranks per point: 1 agent + observers (default 2,4,8,16)")
    parser.add_argument("--batch", type=comma_list(_boolean), default=(True, False),
                        help="comma-separated true/false: one policy call per iteration or one "
                             "per request (default true,false)")
    parser.add_argument("--backend", type=comma_list(choice(BACKENDS)), default=BACKENDS,
                        help=f"comma-separated, among {', '.join(BACKENDS)} (default all)")
    parser.add_argument("--iterations", type=positive_int, default=100,
                        help="timed iterations per point (default 100)")
    parser.add_argument("--warmup", type=non_negative_int, default=10,
                        help="untimed iterations first (default 10)")
    parser.add_argument("--state-size", type=positive_int, default=4,
                        help="float32 values per state (default 4)")
    parser.add_argument("--actions", type=positive_int, default=2,
                        help="the policy's number of actions (default 2)")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds any one wait may take (default 120)")
    parser.add_argument("--json", metavar="PATH", help="write metadata and every point here")
    return parser


def parse_options(argv: Optional[Sequence[str]] = None) -> Tuple[AgentObserverOptions, Optional[str]]:
    """Options and the JSON path from the command line.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).

    Returns:
        The options and the ``--json`` path (or None).

    Raises:
        SystemExit: bad arguments (exit status 2, with argparse's message).
    """
    args = build_parser().parse_args(argv)
    if args.timeout <= 0:
        build_parser().error("--timeout must be positive")
    options = AgentObserverOptions(
        world_sizes=args.world_size, batch_modes=args.batch, backends=args.backend,
        iterations=args.iterations, warmup=args.warmup, state_size=args.state_size,
        actions=args.actions, timeout_s=args.timeout)
    return options, args.json


def observer_ratios(results: Sequence[PointResult], reference: str = "ray",
                    other: str = "torch-rpc") -> Dict[Tuple[bool, int], float]:
    """Observer p50 latency of ``reference`` over ``other``'s, per (batch, world size) where
    both have it (below 1: ``reference`` answers its observers sooner).

    Args:
        results: the points of one run.
        reference: the backend on top of the ratio.
        other: the one below.

    Returns:
        ``{(batch, world size): ratio}``, in the run's order.
    """
    p50 = {(r.backend, r.batch, r.world_size): r.metrics["observer_latency_s"]["p50"]
           for r in results if not r.error}
    return {(batch, world): p50[(reference, batch, world)] / p50[(other, batch, world)]
            for (backend, batch, world) in p50
            if backend == other and (reference, batch, world) in p50}


def format_ratios(results: Sequence[PointResult]) -> str:
    """One line per (batch, world size): observer p50 of this library over ``torch-rpc``'s."""
    return "\n".join(f"observer p50 ray / torch-rpc, batch {str(batch).lower()}, "
                     f"{world - 1} observers: {value:.2f}"
                     for (batch, world), value in observer_ratios(results).items())


def format_table(results: Sequence[PointResult]) -> str:
    """The results as a fixed-width table, one line per point (latencies in ms)."""
    header = (f"{'backend':<11}{'batch':<7}{'world':>6}  "
              f"{'agent latency ms':^27}  {'agent throughput req/s':^31}  "
              f"{'observer latency ms':^27}  {'observer throughput req/s':^31}")
    quantiles = "".join(f"{'p' + str(q):>7}" for q in PERCENTILES)
    lines = [header, f"{'':<24}  {quantiles}  {quantiles}  {quantiles}  {quantiles}"]
    scale = {"agent_latency_s": 1e3, "agent_throughput_rps": 1.0, "observer_latency_s": 1e3,
             "observer_throughput_rps": 1.0}
    for result in results:
        prefix = f"{result.backend:<11}{str(result.batch).lower():<7}{result.world_size:>6}"
        if result.error:
            lines.append(f"{prefix}  error: {result.error}")
            continue
        cells = []
        for metric in METRICS:
            values = result.metrics[metric]
            digits = 2 if metric.endswith("_s") else 0
            cells.append("".join(f"{values[f'p{q}'] * scale[metric]:>7.{digits}f}"
                                 for q in PERCENTILES))
        lines.append(f"{prefix}  " + "  ".join(cells))
    return "\n".join(lines)


def to_json(results: Sequence[PointResult], options: AgentObserverOptions, command: str) -> dict:
    """The JSON document: metadata and one row per point (raw samples included).

    Args:
        results: the points.
        options: the run's options.
        command: the command line.

    Returns:
        A JSON-serializable dict.
    """
    from benchmarks.rows import machine_metadata
    import torch
    metadata = {**machine_metadata(), "torch": torch.__version__, "command": command,
                "options": asdict(options),
                "world_size_meaning": "1 agent (rank 0) + world_size - 1 observers; the driver "
                                      "coordinates and is not a rank"}
    rows = []
    for result in results:
        rows.append({"backend": result.backend, "batch": result.batch,
                     "world_size": result.world_size, "observers": result.world_size - 1,
                     "iterations": result.iterations, **result.metrics,
                     "agent_periods_s": list(result.agent_periods_s),
                     "observer_latencies_s": [list(o.latencies_s) for o in result.observers],
                     "error": result.error})
    ratios = [{"batch": batch, "world_size": world, "observers": world - 1,
               "ray_over_torch_rpc": value}
              for (batch, world), value in observer_ratios(results).items()]
    return {"metadata": metadata, "rows": rows, "observer_p50_ratios": ratios}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the benchmark from the command line; starts and stops its own local Ray.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).

    Returns:
        0 once the sweep ran (failed points show their errors), 2 for bad arguments.
    """
    options, json_path = parse_options(argv)
    import logging

    import ray
    ray.init(address="local", include_dashboard=False, log_to_driver=False,
             logging_level=logging.WARNING)
    try:
        results = run_benchmark(options)
        document = to_json(results, options, shlex.join(["python", "-m", "benchmarks.agent_observer",
                                                         *(sys.argv[1:] if argv is None else argv)]))
    finally:
        ray.shutdown()
    print(format_table(results))
    ratios = format_ratios(results)
    if ratios:
        print(ratios)
    if json_path:
        with open(json_path, "w") as handle:
            json.dump(document, handle, indent=1)
        print(f"wrote {json_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

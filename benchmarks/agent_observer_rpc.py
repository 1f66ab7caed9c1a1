"""The ``torch-rpc`` peer of the agent/observer benchmark: ``torch.distributed.rpc`` as PyTorch's
own reinforcement-learning RPC benchmark uses it.

The pattern of that benchmark (one agent, N observers, CPU, TensorPipe): the agent's object
lives on the agent's worker and is reached through an ``RRef``; the coordinator creates each
observer's object remotely (``rpc.remote``) and starts every observer's episode with
``rpc_async``; an observer asks for each action with ``rpc_sync(agent_rref.owner(),
select_action, args=(agent_rref, observer, state))`` and times that call. Without batching
the agent runs its policy on the one state and answers; with batching ``select_action`` is an
``@rpc.functions.async_execution`` function that returns a future, completed for all N
observers of an iteration at once after one policy call on their stacked states.

Here every rank is a Ray actor of the benchmark (``agent_observer.BenchmarkRank``), the same
processes as the other backends': each joins the RPC world (``join``: rank 0 named ``agent``,
the others ``observer<r>``, TensorPipe with the rendezvous store at the address the driver
picked on its node), and the agent's actor plays the coordinator (``coordinate``) since the
driver is not in the RPC world; it is not on any timed path. ``leave`` is RPC's graceful
shutdown, which every rank must call together. Values cross RPC as plain tuples, numbers and
tensors, never as the benchmark's own classes, which exist twice when the benchmark runs as
``__main__``. The module imports torch: only the ranks import it (``BenchmarkRank``'s
``rpc_*`` methods), never the driver.
"""

from __future__ import annotations

import threading
from dataclasses import asdict
from typing import List, Tuple

import numpy as np
import torch
import torch.distributed.rpc as rpc

from .agent_observer import (AgentObserverOptions, AgentState, ObserverRecord, observe_loop,
                             select_actions)

AGENT_NAME = "agent"
"""The agent's (rank 0's) name in the RPC world."""


def observer_name(rank: int) -> str:
    """Observer ``rank``'s name in the RPC world."""
    return f"observer{rank}"


def join(rank: int, world_size: int, init_method: str, timeout_s: float) -> str:
    """Join the RPC world as ``rank``; returns once every rank has joined.

    Args:
        rank: 0 for the agent, 1..world_size-1 for the observers.
        world_size: ranks in the RPC world.
        init_method: ``tcp://host:port`` of the rendezvous store (rank 0 serves it).
        timeout_s: the deadline of every RPC (and of the rendezvous).

    Returns:
        torch's version.
    """
    torch.set_num_threads(1)
    options = rpc.TensorPipeRpcBackendOptions(init_method=init_method, rpc_timeout=timeout_s)
    rpc.init_rpc(AGENT_NAME if rank == 0 else observer_name(rank), rank=rank,
                 world_size=world_size, rpc_backend_options=options)
    return torch.__version__


def leave() -> None:
    """RPC's graceful shutdown: waits for every rank to call it."""
    rpc.shutdown()


class RpcAgent(AgentState):
    """The agent's object, on rank 0, reached by the observers through an ``RRef``; its
    batched answers are torch futures, and a lock guards the bookkeeping, since RPC serves
    requests on a pool of threads."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lock = threading.Lock()

    @staticmethod
    def select_action(agent_rref, iteration: int, state):
        """One observer's request without batching: the policy on its state, the action.

        Args:
            agent_rref: the agent's ``RRef`` (this worker owns it).
            iteration: the observer's iteration.
            state: its state, a float32 tensor.

        Returns:
            The action.
        """
        agent = agent_rref.local_value()
        action = int(select_actions(agent.policy, state.numpy()[None, :])[0])
        with agent.lock:
            agent.count_served(iteration, 1)
        return action

    @staticmethod
    @rpc.functions.async_execution
    def select_action_batch(agent_rref, iteration: int, state):
        """One observer's request with batching: a future, completed with the action once
        every observer's state of ``iteration`` is in and the policy ran on them all."""
        agent = agent_rref.local_value()
        answer = torch.futures.Future()
        with agent.lock:
            waiting = agent.pending.setdefault(iteration, [])
            waiting.append((state.numpy(), answer))
            complete = len(waiting) == agent.observers
            if complete:
                del agent.pending[iteration]
                agent.count_served(iteration, len(waiting))
        if complete:
            chosen = select_actions(agent.policy, np.stack([s for s, _ in waiting]))
            for (_, future), action in zip(waiting, chosen):
                future.set_result(int(action))
        return answer


class RpcObserver:
    """An observer's object, created on its worker by the coordinator (``rpc.remote``)."""

    def __init__(self, rank: int, settings: Tuple) -> None:
        self.rank = rank
        self.settings = settings

    def run_episode(self, agent_rref, batch: bool) -> Tuple:
        """Every iteration: ``rpc_sync`` the state to the agent, time it until the action.

        Args:
            agent_rref: the agent's ``RRef``.
            batch: whether the agent batches an iteration's requests.

        Returns:
            ``(latencies, states, actions)`` of ``ObserverRecord``'s fields.
        """
        options = AgentObserverOptions(**dict(self.settings))
        owner = agent_rref.owner()
        select = RpcAgent.select_action_batch if batch else RpcAgent.select_action

        def request(state: np.ndarray, iteration: int) -> int:
            return rpc.rpc_sync(owner, select, args=(agent_rref, iteration,
                                                     torch.from_numpy(state)))

        record = observe_loop(options, self.rank, request)
        return record.latencies_s, record.states, record.actions


def coordinate(options: AgentObserverOptions, world_size: int,
               batch: bool) -> Tuple[List[float], List[ObserverRecord]]:
    """On the agent's rank: create the agent and the observers, run every observer's episode
    at once (``rpc_async``), and collect what they measured.

    Args:
        options: the benchmark's ``AgentObserverOptions``.
        world_size: 1 agent + observers.
        batch: one policy call per iteration, or one per request.

    Returns:
        The agent's iteration periods and each observer's record, in rank order.
    """
    settings = tuple(sorted((name, value) for name, value in asdict(options).items()
                            if not isinstance(value, tuple)))
    agent = RpcAgent(options, world_size - 1, batch)
    agent_rref = rpc.RRef(agent)
    observers = [rpc.remote(observer_name(rank), RpcObserver, args=(rank, settings))
                 for rank in range(1, world_size)]
    episodes = [observer.rpc_async(timeout=_episode_timeout(options)).run_episode(agent_rref,
                                                                                   batch)
                for observer in observers]
    answers = torch.futures.wait_all(episodes)
    records = [ObserverRecord(tuple(latencies), np.asarray(states, np.float32),
                              np.asarray(actions, np.int64))
               for latencies, states, actions in answers]
    return agent.periods(), records


def _episode_timeout(options: AgentObserverOptions) -> float:
    # An episode is many requests, each with its own deadline; the whole gets a generous one.
    return options.timeout_s * 2

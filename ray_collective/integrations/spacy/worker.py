"""One training worker, a Ray actor: spaCy's own training loop on its shard of the corpus.

The driver (``driver.py``) initializes the pipeline once and hands every worker the same bytes,
so that all start from the same weights and labels; each worker rebuilds the pipeline from the
config, resolves ``[training]`` as ``spacy train`` does, and runs
``spacy.training.loop.train_while_improving`` on a thread with:

- its shard of the training corpus: example ``i`` of the config's reader goes to worker
  ``i mod N``, batched by the config's batcher;
- an exchange (``exchanges.py``) as the optimizer, through which every gradient goes;
- an evaluation that rank 0 runs on the whole dev corpus and broadcasts (its score decides
  patience and the best checkpoint, so every worker stops at the same step); under the
  parameter server, which has no group, the other workers neither evaluate nor stop early, and
  the driver stops them when rank 0 is done.

Rank 0 saves ``model-last`` and ``model-best`` as ``spacy train`` does, and keeps each
evaluated step's row for the driver, which prints them with the config's logger. Where a
config's epochs are finite (``max_epochs > 0``) the workers agree on every step that each still
has a batch, since their shards end at different steps.

Training runs on a thread so that the actor's own thread serves the parameter server's
``inc_grad`` / ``set_param`` calls and the driver's ``progress``, which runs in the ``control``
concurrency group and so never waits behind training.
"""

from __future__ import annotations

import dataclasses
import itertools
import pathlib
import shutil
import threading
import time
import traceback
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np
import spacy
from spacy.cli._util import import_code
from spacy.schemas import ConfigSchemaTraining
from spacy.training.loop import (DIR_MODEL_BEST, DIR_MODEL_LAST, create_before_to_disk_callback,
                                 create_evaluation_callback, create_train_batches,
                                 train_while_improving, update_meta)
from spacy.util import load_model_from_config, registry, resolve_dot_names
from thinc.api import Config, Model, fix_random_seed

from ...errors import CollectiveError
from ..thinc import communicators
from ..thinc.params import parameter_count, parameter_digest
from . import exchanges
from .settings import RunSettings

CONTROL_GROUP = "control"
"""The actor's concurrency group for the driver's calls that must not wait behind training."""


def trainable_components(nlp: Any, frozen: List[str]) -> List[Tuple[str, Any]]:
    """The components spaCy's loop updates: trainable, with a model, not frozen.

    Args:
        nlp: the pipeline.
        frozen: ``[training] frozen_components``.

    Returns:
        ``(name, component)`` pairs in pipeline order.
    """
    return [(name, proc) for name, proc in nlp.pipeline
            if name not in frozen and getattr(proc, "is_trainable", False)
            and proc.model not in (True, False, None)]


def holder_model(components: List[Tuple[str, Any]]) -> Any:
    """One thinc model whose layers are the components' models, so one walk covers them all.

    Args:
        components: from ``trainable_components``.

    Returns:
        A thinc Model that is never run.

    Raises:
        ValueError: a component's model holds parameters outside thinc (a PyTorch or
            TensorFlow shim), which no exchange sees.
    """
    models = [proc.model for _, proc in components]
    for name, proc in components:
        if any(node.shims for node in proc.model.walk()):
            raise ValueError(f"component {name!r} wraps a PyTorch or TensorFlow model (a thinc "
                             f"shim): its parameters live outside thinc, where this command "
                             f"cannot average them; train it with `spacy train`")
    return Model("ray-collective-pipeline", lambda model, X, is_train: (X, lambda dY: dY),
                 layers=models)


@dataclasses.dataclass
class WorkerReport:
    """What one worker measured (times on the machine's monotonic clock).

    Attributes:
        rank: the worker.
        steps: updates made.
        started, ended: the first step's start and the last step's end (after the final flush).
        compute_seconds: the loop's time less communication and evaluation.
        communication_seconds: time in collectives, or submitting the server's calls.
        serve_seconds: the parameter server: the actor thread's time serving peers' calls.
        evaluation_seconds: time evaluating, or waiting for rank 0's evaluation.
        bus_bytes: bytes this worker's collectives must send.
        actor_calls, bytes_sent: the parameter server's calls and the array bytes they carried.
        grads_dropped, grads_accepted: the parameter server's stale and used gradients.
        words: words of this worker's batches.
        parameters: floats in the trainable components.
        digests: a hash of the parameters after every step (``record_digests``).
        final_digest: that hash after the run.
        final_score: rank 0: the last evaluation's score.
    """

    rank: int
    steps: int = 0
    started: float = 0.0
    ended: float = 0.0
    compute_seconds: float = 0.0
    communication_seconds: float = 0.0
    evaluation_seconds: float = 0.0
    serve_seconds: float = 0.0
    bus_bytes: int = 0
    actor_calls: int = 0
    bytes_sent: int = 0
    grads_dropped: int = 0
    grads_accepted: int = 0
    words: int = 0
    parameters: int = 0
    digests: List[str] = dataclasses.field(default_factory=list)
    final_digest: str = ""
    final_score: Optional[float] = None


@dataclasses.dataclass(frozen=True)
class WorkerFailure:
    """How one worker's training failed.

    Attributes:
        rank: the worker.
        in_collective: the failure came out of a collective (a peer's failure or death, a
            timeout), so it is most likely the consequence of another rank's; otherwise spaCy's
            loop itself raised on this rank.
        traceback: the exception's formatted traceback.
    """

    rank: int
    in_collective: bool
    traceback: str


class SpacyWorker:
    """One worker: builds the pipeline, joins its peers, trains on a thread, reports."""

    def setup(self, rank: int, settings: RunSettings,
              pipeline: Tuple[str, bytes]) -> Dict[str, Any]:
        """Rebuild the initialized pipeline and resolve the training settings.

        Args:
            rank: this worker's rank.
            settings: the run.
            pipeline: the initialized pipeline's config (``nlp.config.to_str()``) and
                ``nlp.to_bytes()``.

        Returns:
            What every worker must agree on: the pipeline, its labels and parameter count.
        """
        self.rank, self.settings = rank, settings
        if settings.code_path:
            import_code(settings.code_path)
        if settings.gpu_id >= 0:
            spacy.require_gpu(0)
        config_text, pipeline_bytes = pipeline
        config = Config().from_str(config_text, interpolate=False)
        self.nlp = load_model_from_config(config, auto_fill=False, validate=False)
        self.nlp.from_bytes(pipeline_bytes)
        resolved = self.nlp.config.interpolate()
        if resolved["training"]["seed"] is not None:
            fix_random_seed(resolved["training"]["seed"] + rank)
        self.training = registry.resolve(resolved["training"], schema=ConfigSchemaTraining)
        self.train_corpus, self.dev_corpus = resolve_dot_names(
            resolved, [self.training["train_corpus"], self.training["dev_corpus"]])
        self.frozen = list(self.training["frozen_components"])
        self.holder = holder_model(trainable_components(self.nlp, self.frozen))
        self.report = WorkerReport(rank=rank, parameters=parameter_count(self.holder))
        self.rows: List[Dict[str, Any]] = []
        self.changed = threading.Condition()
        self.stopping = threading.Event()
        self.done = False
        self.failure: Optional[WorkerFailure] = None
        self.exchange: Optional[exchanges.Exchange] = None
        return {"pipeline": list(self.nlp.pipe_names), "parameters": self.report.parameters,
                "labels": {name: list(getattr(proc, "labels", ()))
                           for name, proc in self.nlp.pipeline}}

    def join(self, peers: List[Any], group_name: str) -> None:
        """Form the exchange; a collective group's join returns once every worker has joined.

        Args:
            peers: every worker's actor handle, by rank (the parameter server's peers).
            group_name: the collective group's name, unique to the run.
        """
        settings, optimizer = self.settings, self.training["optimizer"]
        self.peers = peers
        if settings.strategy == "parameter-server":
            self.exchange = exchanges.ParameterServerExchange(
                optimizer, self.holder, self.rank, peers, settings.timeout_s,
                settings.grads_per_update)
            return
        world = len(peers)
        if settings.library == "ray_collective":
            communicator = communicators.RayCollectiveCommunicator(
                world, self.rank, group_name, settings.backend, settings.timeout_s)
        else:
            communicator = communicators.RayUtilGlooCommunicator(
                world, self.rank, group_name, settings.timeout_s)
        if settings.strategy == "allreduce":
            self.exchange = exchanges.AllreduceExchange(optimizer, self.holder, communicator)
        else:
            self.exchange = exchanges.ReduceScatterExchange(
                optimizer, self.holder, communicator, self.training["eval_frequency"])

    def start(self) -> None:
        """Start training on a thread and return at once."""
        self.thread = threading.Thread(target=self._train_guarded, name="spacy-training",
                                       daemon=True)
        self.thread.start()

    def progress(self, since: int, wait_s: float) -> Tuple[List[Dict[str, Any]], bool]:
        """Rank 0's evaluated rows after the first ``since``, waiting up to ``wait_s`` for one.

        Args:
            since: rows the caller has already.
            wait_s: the longest to wait for a new row.

        Returns:
            ``(new rows, whether training is over)``; each row is ``{"info": ..., "best": ...}``.
        """
        with self.changed:
            self.changed.wait_for(lambda: len(self.rows) > since or self.done, timeout=wait_s)
            return self.rows[since:], self.done

    def stop(self) -> None:
        """End training after the current step (the parameter server's other workers)."""
        self.stopping.set()

    def result(self) -> Tuple[Optional[Dict[str, Any]], Optional[WorkerFailure]]:
        """Wait for training to end; the parameter server also serves its peers' last calls.

        Returns:
            ``(the WorkerReport as a dict, None)``, or ``(None, how it failed)``: the driver
            sees every rank's outcome and names the rank that failed first, whichever
            outcome arrives first.
        """
        self.thread.join()
        if self.failure is not None:
            return None, self.failure
        if isinstance(self.exchange, exchanges.ParameterServerExchange):
            self._drain()
        return dataclasses.asdict(self.report), None

    def close(self) -> None:
        """Leave the collective group, if any."""
        communicator = getattr(self.exchange, "communicator", None)
        if communicator is not None:
            communicator.close()

    # spacy-ray's peer methods: the names its proxies call on one another.

    def inc_grad(self, key: Tuple[int, str], version: int, value: Any) -> None:
        """A peer's gradient of an array this worker owns."""
        self.exchange.proxy.receive_grad(tuple(key), version, value)

    def set_param(self, key: Tuple[int, str], version: int, value: Any) -> None:
        """An owner's new value of an array."""
        # Ray hands over arrays read-only (zero-copy); thinc's HashEmbed needs writable ones.
        self.exchange.proxy.receive_param(tuple(key), version,
                                          value if value.flags.writeable else value.copy())

    def peer_done(self, calls_sent_to_us: int) -> None:
        """A peer's training is over; it made ``calls_sent_to_us`` calls to this worker."""
        self.exchange.proxy.peer_finished(calls_sent_to_us)

    # ---------------------------------------------------------------- training

    def _train_guarded(self) -> None:
        try:
            self._train()
        except CollectiveError:  # reported to the driver by result()
            self.failure = WorkerFailure(self.rank, True, traceback.format_exc())
        except Exception as err:  # reported to the driver by result()
            self.failure = WorkerFailure(self.rank, False, traceback.format_exc())
            communicator = getattr(self.exchange, "communicator", None)
            if communicator is not None:
                # The others may be waiting for this rank in a collective: they fail now.
                communicator.abort(RuntimeError(f"rank {self.rank} failed in spaCy's training "
                                                f"loop: {type(err).__name__}: {err}"))
        finally:
            with self.changed:
                self.done = True
                self.changed.notify_all()

    def _train(self) -> None:
        training, report, exchange = self.training, self.report, self.exchange
        server = isinstance(exchange, exchanges.ParameterServerExchange)
        steps = train_while_improving(
            self.nlp, exchange, self._batches(), self._evaluate_callback(),
            dropout=training["dropout"], accumulate_gradient=training["accumulate_gradient"],
            # Under the server only rank 0 evaluates: the others run until it is done.
            patience=0 if server and self.rank else training["patience"],
            max_steps=training["max_steps"], eval_frequency=training["eval_frequency"],
            exclude=self.frozen, annotating_components=training["annotating_components"],
            before_update=training["before_update"])
        for batch, info, is_best in steps:
            report.steps += 1
            report.words = info["words"]
            if self.settings.record_digests:
                report.digests.append(parameter_digest(self.holder))
            if is_best is not None and self.rank == 0:
                self._checkpoint(info, is_best)
        exchange.finish()
        exchange.gather_averages()
        report.ended = time.monotonic()
        self._count(report.ended - report.started)
        report.final_digest = parameter_digest(self.holder)
        if self.rank == 0:
            self._save(DIR_MODEL_LAST)

    def _batches(self) -> Iterator[Tuple[int, List[Any]]]:
        """This worker's batches; with finite epochs, every worker stops when one runs out."""
        rank, world = self.rank, self.settings.workers
        corpus = self.train_corpus

        def shard(nlp: Any) -> Iterator[Any]:
            return itertools.islice(corpus(nlp), rank, None, world)

        batches = create_train_batches(self.nlp, shard, self.training["batcher"],
                                       self.training["max_epochs"])
        communicator = getattr(self.exchange, "communicator", None)
        agree = communicator is not None and self.training["max_epochs"] > 0
        while not self.stopping.is_set():
            batch = next(batches, None)
            if agree:
                still = np.array([0.0 if batch is None else 1.0])
                communicator.allreduce_sum(still)
                if still[0] < world:
                    return
            if batch is None:
                return
            if not self.report.started:
                self.report.started = time.monotonic()
            yield batch

    def _evaluate_callback(self) -> Any:
        """Rank 0 evaluates on the dev corpus; a group's other workers receive its score."""
        evaluate = create_evaluation_callback(self.nlp, self.dev_corpus,
                                              self.training["score_weights"])
        communicator = getattr(self.exchange, "communicator", None)

        def evaluated() -> Tuple[float, Dict[str, Any]]:
            started = time.monotonic()
            score, scores = evaluate() if self.rank == 0 else (0.0, {})
            if communicator is not None:
                value = np.array([score], dtype=np.float64)
                communicator.broadcast(value, 0)
                score = float(value[0])
            self.report.evaluation_seconds += time.monotonic() - started
            return score, scores

        return evaluated

    def _checkpoint(self, info: Dict[str, Any], is_best: bool) -> None:
        """Rank 0 at an evaluated step: the row for the driver, and ``spacy train``'s saves."""
        with self.nlp.select_pipes(disable=self.frozen):
            update_meta(self.training, self.nlp, info)
        if self.settings.output_path:
            self._save(DIR_MODEL_LAST)
            info["output_path"] = str(pathlib.Path(self.settings.output_path) / DIR_MODEL_LAST)
            if is_best:
                best = pathlib.Path(self.settings.output_path) / DIR_MODEL_BEST
                shutil.rmtree(best, ignore_errors=True)
                shutil.copytree(pathlib.Path(self.settings.output_path) / DIR_MODEL_LAST, best)
        self.report.final_score = info["score"]
        with self.changed:
            self.rows.append({"info": dict(info, losses=dict(info["losses"]),
                                           checkpoints=list(info["checkpoints"])),
                              "best": is_best})
            self.changed.notify_all()

    def _save(self, directory: str) -> None:
        if not self.settings.output_path:
            return
        before_to_disk = create_before_to_disk_callback(self.training["before_to_disk"])
        with self.nlp.use_params(self.exchange.averages):
            before_to_disk(self.nlp).to_disk(pathlib.Path(self.settings.output_path) / directory)

    def _count(self, elapsed: float) -> None:
        report, exchange = self.report, self.exchange
        communication = exchange.clock.communication_seconds
        report.bus_bytes = exchange.bus_bytes
        if isinstance(exchange, exchanges.ParameterServerExchange):
            counters = exchange.proxy.counters
            communication += counters.send_seconds
            report.serve_seconds = counters.serve_seconds
            report.actor_calls, report.bytes_sent = counters.actor_calls, counters.bytes_sent
            report.grads_dropped = counters.grads_dropped
            report.grads_accepted = counters.grads_accepted
        report.communication_seconds = communication
        report.compute_seconds = max(0.0, elapsed - communication - report.evaluation_seconds)

    def _drain(self) -> None:
        """Tell each peer how many calls it must serve, then serve ours (parameter server)."""
        proxy = self.exchange.proxy
        for index, peer in enumerate(self.peers):
            if index != self.rank:
                peer.peer_done.remote(proxy.calls_sent_to(index))
        proxy.wait_drained(self.settings.timeout_s)
        self._count(self.report.ended - self.report.started)


def actor_class(settings: RunSettings) -> Any:
    """``SpacyWorker`` as a Ray actor class for the run's resources.

    Args:
        settings: the run (``gpu_id >= 0``: one GPU per worker).

    Returns:
        The actor class.
    """
    import ray
    return ray.remote(num_cpus=0, num_gpus=1 if settings.gpu_id >= 0 else 0,
                      concurrency_groups={CONTROL_GROUP: 1})(SpacyWorker)

"""The driver of a distributed spaCy training run: initialize once, train on N actors, report.

``train`` does what ``spacy train`` does, with the training spread over Ray actors:

1. the pipeline is initialized here, once (``spacy.training.initialize.init_nlp``: labels
   from the corpus, weights from the seed), and every worker gets its bytes and config, so
   all start from the same weights whatever the strategy;
2. N ``SpacyWorker`` actors (``num_cpus=0``, rank 0 on this node, where the output directory
   is) rebuild it, agree on its labels and size (a worker that differs stops the run before
   any training), form their exchange (a collective group, or the parameter server's peer
   table) and train (``worker.py``);
3. rank 0's evaluated rows are printed here with the config's own logger (spaCy's console
   table by default) as they come; under the parameter server the other workers are stopped
   once rank 0 is done;
4. the result: every worker's report, rank 0's rows, and where rank 0 saved the pipeline.

Ray is started here (``ray.init(address=...)``) unless the caller already has it.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import IO, Any, Dict, List, Optional

import ray
from spacy.schemas import ConfigSchemaTraining
from spacy.training.initialize import init_nlp
from spacy.training.loop import DIR_MODEL_LAST
from spacy.util import registry
from thinc.api import Config
from wasabi import Printer

from .settings import RunSettings
from .worker import CONTROL_GROUP, WorkerFailure, WorkerReport, actor_class

POLL_S = 1.0
"""How long one progress call waits for rank 0's next row."""


@dataclass(frozen=True)
class TrainingResult:
    """A finished run.

    Attributes:
        settings: the run's options.
        reports: every worker's report, by rank.
        rows: rank 0's evaluated rows (spaCy's ``info`` dicts), in order.
        output: the saved pipeline's directory (``model-last``), if any.
    """

    settings: RunSettings
    reports: List[WorkerReport]
    rows: List[Dict[str, Any]]
    output: Optional[str]

    @property
    def seconds(self) -> float:
        """The run's time: from the earliest first step to the latest last step."""
        return max(r.ended for r in self.reports) - min(r.started for r in self.reports)


class WorkersDisagreeError(RuntimeError):
    """The workers rebuilt different pipelines from the same bytes (a custom component whose
    initialization is not deterministic); nothing was trained."""


class TrainingFailedError(RuntimeError):
    """Training failed on one or more workers; the message names the rank that failed first
    (spaCy's loop raised there) and the ranks that stopped because of it.

    Attributes:
        failures: every failed worker's ``WorkerFailure``, by rank.
    """

    def __init__(self, failures: List[WorkerFailure]) -> None:
        self.failures = failures
        first = [failure for failure in failures if not failure.in_collective]
        followers = [failure for failure in failures if failure.in_collective]
        if first:
            message = f"{_ranks(first)} failed in spaCy's training loop"
            if followers:
                message += f" ({_ranks(followers)} stopped because of it)"
        else:  # every failure came out of a collective: a death or a timeout, say
            first = failures
            message = f"{_ranks(first)} failed in a collective"
        super().__init__(f"{message}; rank {first[0].rank}'s traceback:\n{first[0].traceback}")


def _ranks(failures: List[WorkerFailure]) -> str:
    """``rank 3`` or ``ranks 0, 1``."""
    ranks = ", ".join(str(failure.rank) for failure in failures)
    return f"rank{'s' if len(failures) > 1 else ''} {ranks}"


def start_workers(settings: RunSettings) -> List[Any]:
    """The run's actors; rank 0 on this node, so that its saves land where the driver is.

    Args:
        settings: the run.

    Returns:
        Actor handles by rank.
    """
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    worker = actor_class(settings)
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return [worker.options(scheduling_strategy=here).remote()] + [
        worker.remote() for _ in range(settings.workers - 1)]


def train(config: Config, settings: RunSettings, *, stdout: Optional[IO] = None,
          address: Optional[str] = None, workers: Optional[List[Any]] = None) -> TrainingResult:
    """Initialize the pipeline of ``config`` and train it on ``settings.workers`` actors.

    Args:
        config: the loaded config, overrides applied, not interpolated (``spacy.util.
            load_config(path, overrides, interpolate=False)``).
        settings: the run.
        stdout: where spaCy's messages and the progress table go (None: ``sys.stdout``).
        address: the Ray cluster to join when Ray is not started yet (None: a local one).
        workers: actors from ``start_workers`` to use instead of new ones (kept afterwards).

    Returns:
        The result.

    Raises:
        WorkersDisagreeError: the workers' pipelines differ.
        TrainingFailedError: a worker failed (the first failed rank and its traceback in the
            message).
        spacy's and thinc's config errors: the config is invalid (``init_nlp``).
    """
    msg, stdout = Printer(no_print=True), stdout or sys.stdout
    nlp = init_nlp(config, use_gpu=settings.gpu_id)
    stdout.write(msg.good("Initialized pipeline") + "\n")
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, log_to_driver=True,
                 logging_level="ERROR")
    own_workers = workers is None
    actors = start_workers(settings) if own_workers else workers[:settings.workers]
    try:
        return _run(nlp, settings, actors, stdout, msg)
    finally:
        if own_workers:
            for actor in actors:
                ray.kill(actor)


def _run(nlp: Any, settings: RunSettings, actors: List[Any], stdout: IO,
         msg: Printer) -> TrainingResult:
    timeout = settings.timeout_s
    payload = ray.put((nlp.config.to_str(), nlp.to_bytes()))
    signatures = ray.get([actor.setup.remote(rank, settings, payload)
                          for rank, actor in enumerate(actors)], timeout=timeout)
    for rank, signature in enumerate(signatures):
        if signature != signatures[0]:
            raise WorkersDisagreeError(
                f"worker {rank} rebuilt {signature}, worker 0 {signatures[0]}: every worker "
                f"must rebuild the same pipeline from the same bytes")
    group = f"spacy-{settings.strategy}-{time.monotonic_ns()}"
    ray.get([actor.join.remote(actors, group) for actor in actors], timeout=timeout)
    training = registry.resolve(nlp.config.interpolate()["training"],
                                schema=ConfigSchemaTraining)
    stdout.write(msg.info(f"Pipeline: {nlp.pipe_names}") + "\n")
    stdout.write(msg.info(f"Workers: {settings.workers}, strategy: {settings.strategy} "
                          f"({settings.library})") + "\n")
    stdout.write(msg.info(f"Initial learn rate: {training['optimizer'].learn_rate}") + "\n")
    frozen = training["frozen_components"]
    with nlp.select_pipes(disable=frozen):
        log_step, finalize_logger = training["logger"](nlp, stdout, sys.stderr)
    ray.get([actor.start.remote() for actor in actors], timeout=timeout)
    rows: List[Dict[str, Any]] = []
    try:
        done = False
        while not done:
            new, done = ray.get(actors[0].progress.options(concurrency_group=CONTROL_GROUP)
                                .remote(len(rows), POLL_S), timeout=timeout)
            for row in new:
                log_step(row["info"])
            rows.extend(row["info"] for row in new)
    finally:
        finalize_logger()
    if settings.strategy == "parameter-server":
        for actor in actors[1:]:
            actor.stop.options(concurrency_group=CONTROL_GROUP).remote()
    outcomes = ray.get([actor.result.options(concurrency_group=CONTROL_GROUP).remote()
                        for actor in actors], timeout=timeout)
    failures = [failure for _, failure in outcomes if failure is not None]
    if failures:
        raise TrainingFailedError(failures)
    results = [report for report, _ in outcomes]
    ray.get([actor.close.remote() for actor in actors], timeout=timeout)
    output = None
    if settings.output_path:
        output = f"{settings.output_path}/{DIR_MODEL_LAST}"
        stdout.write(msg.good("Saved pipeline to output directory", output) + "\n")
    return TrainingResult(settings, [WorkerReport(**result) for result in results], rows, output)

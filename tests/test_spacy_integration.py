"""spaCy on Ray workers (``python -m spacy ray-collective``), and the corpus it trains on.

The tiny runs (2 workers, a small tok2vec + ner, a few dozen updates on the generated corpus)
go through spaCy's own CLI app with the entry point loaded, as ``python -m spacy`` does, or
through the driver where a test needs what workers record. What they are checked against is
independent of the exchanges: ``spacy train`` itself (one worker must print its very table),
thinc's own optimizer applied to the summed gradient (the reduce-scatter exchange's clipped
shard update), a hash of every worker's weights after every step, ``spacy.load`` of what
was saved, and the exact text of each generated entity.
"""

import hashlib
import importlib.metadata
import json
import re
import sys
import time

import numpy as np
import pytest

from support import extras

spacy = extras.need("spacy", "the spaCy integration")
extras.need("faker", "the spaCy integration's corpus")

import typer.testing  # noqa: E402
from spacy.cli._util import app as spacy_app  # noqa: E402
from spacy.cli._util import import_code  # noqa: E402
from spacy.cli.init_config import init_config  # noqa: E402
from spacy.util import load_config, registry  # noqa: E402
from thinc.api import SGD, Adam, Relu, Softmax, chain, fix_random_seed  # noqa: E402

import ray_collective as col  # noqa: E402
from ray_collective.integrations.spacy import corpus, exchanges  # noqa: E402
from ray_collective.integrations.spacy.settings import RunSettings  # noqa: E402
from ray_collective.integrations.spacy.worker import WorkerFailure  # noqa: E402
from ray_collective.integrations.thinc.communicators import (  # noqa: E402
    Communicator, RayCollectiveCommunicator)
from ray_collective.integrations.thinc.params import parameter_vector  # noqa: E402
from ray_collective.testing import run_ranks  # noqa: E402

STEPS = 24
ROWS = re.compile(r"^\s*(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)", re.MULTILINE)
"""A row of spaCy's console table: epoch, step, tok2vec loss, ner loss, ents_f."""


def _driver():
    """The spaCy integration's driver, which imports Ray: a unit test that needs it skips where
    Ray cannot be imported (``pytest -m unit`` runs without Ray)."""
    pytest.importorskip("ray", reason="the spaCy driver runs on Ray")
    from ray_collective.integrations.spacy import driver
    return driver


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("corpus")
    corpus.write_corpus(directory, train=300, dev=60, seed=0)
    return directory


@pytest.fixture(scope="module")
def config_path(tmp_path_factory, corpus_dir):
    """spaCy's own efficiency tok2vec + ner config, made small and quick to learn."""
    config = init_config(lang="en", pipeline=["ner"], optimize="efficiency", silent=True)
    config["paths"]["train"] = str(corpus_dir / "train.spacy")
    config["paths"]["dev"] = str(corpus_dir / "dev.spacy")
    tok2vec = config["components"]["tok2vec"]["model"]
    tok2vec["encode"]["width"], tok2vec["encode"]["depth"] = 32, 2
    tok2vec["embed"]["rows"] = [1000, 500, 500, 500]
    config["components"]["ner"]["model"]["hidden_width"] = 32
    config["training"]["batcher"] = {"@batchers": "spacy.batch_by_sequence.v1", "size": 16,
                                     "get_length": None}
    config["training"]["optimizer"]["learn_rate"] = 0.01
    config["training"]["max_steps"] = STEPS
    config["training"]["eval_frequency"] = 8
    path = tmp_path_factory.mktemp("config") / "config.cfg"
    config.to_disk(path)
    return path


def spacy_cli(*args):
    """``python -m spacy ARGS`` in this process: spaCy's app, every spacy_cli entry point in."""
    registry.cli.get_all()
    return typer.testing.CliRunner().invoke(spacy_app, list(args))


def table(output):
    return [tuple(float(x) for x in row) for row in ROWS.findall(output)]


# ------------------------------------------------------------------ the command


def test_the_entry_point_adds_ray_collective_to_spacys_cli():
    found = [entry for entry in importlib.metadata.entry_points(group="spacy_cli")
             if entry.name == "ray-collective"]
    assert [entry.value for entry in found] == [
        "ray_collective.integrations.spacy.cli:ray_collective_cli"]
    result = spacy_cli("ray-collective", "--help")
    assert result.exit_code == 0, result.output
    assert "train" in result.output and "corpus" in result.output


def test_a_config_error_gives_spacys_own_message_before_any_worker_starts(config_path):
    pytest.importorskip("ray", reason="spaCy's command line loads the driver, which imports Ray")
    wrong = ("--components.ner.model.hidden_width", "wide")
    ours = spacy_cli("ray-collective", "train", str(config_path), "--n-workers", "2", *wrong)
    theirs = spacy_cli("train", str(config_path), *wrong)
    assert ours.exit_code == theirs.exit_code == 1
    error = theirs.output[theirs.output.index("Config error"):]
    assert "hidden_width" in error and ours.output.endswith(error)
    assert "Workers:" not in ours.output


def test_bad_options_are_refused_by_name(config_path):
    pytest.importorskip("ray", reason="spaCy's command line loads the driver, which imports Ray")
    result = spacy_cli("ray-collective", "train", str(config_path), "--strategy", "gossip")
    assert result.exit_code == 1 and "unknown strategy 'gossip'" in result.output
    result = spacy_cli("ray-collective", "train", str(config_path), "--n-workers", "0")
    assert result.exit_code == 1 and "--n-workers must be at least 1" in result.output


# ------------------------------------------------------------------ the corpus


def test_the_corpus_is_the_same_for_a_seed_and_its_entities_are_the_filled_slots(tmp_path):
    first, second, other = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    for directory, seed in ((first, 3), (second, 3), (other, 4)):
        result = spacy_cli("ray-collective", "corpus", str(directory), "--train", "40",
                           "--dev", "10", "--seed", str(seed))
        assert result.exit_code == 0, result.output

    def digest(path):
        return hashlib.sha256(path.read_bytes()).hexdigest()

    for name in ("train.spacy", "dev.spacy"):
        assert digest(first / name) == digest(second / name)
        assert digest(first / name) != digest(other / name)
    nlp = spacy.blank("en")
    docs = list(spacy.tokens.DocBin().from_disk(first / "train.spacy").get_docs(nlp.vocab))
    assert len(docs) == 40
    labels = {entity.label_ for doc in docs for entity in doc.ents}
    assert labels == set(corpus.LABELS)
    for doc in docs:
        for entity in doc.ents:
            assert entity.text == entity.text.strip() and entity.text
    examples = list(spacy.training.Corpus(first / "dev.spacy")(nlp))
    assert len(examples) == 10


def test_an_empty_corpus_is_refused(tmp_path):
    result = spacy_cli("ray-collective", "corpus", str(tmp_path), "--train", "0")
    assert result.exit_code == 1 and "at least one sentence" in result.output


# ------------------------------------------------------------------ the exchanges, in-process


def test_shard_segments_cover_every_element_once():
    sizes = [7, 1, 12, 5]
    for world in (1, 2, 3, 8):
        covered = []
        for rank in range(world):
            arrays, starts, lengths = exchanges.shard_segments(sizes, world, rank)
            part = -(-sum(sizes) // world)
            offsets = np.cumsum([0] + sizes)
            for array, start, length in zip(arrays, starts, lengths):
                first = rank * part + start
                assert offsets[array] <= first and first + length <= offsets[array + 1]
                covered.extend(range(first, first + length))
        assert covered == list(range(sum(sizes)))


class JoinedCommunicator(RayCollectiveCommunicator):
    """This library's communicator on a group ``run_ranks`` has already joined."""

    def __init__(self, world_size, rank):
        Communicator.__init__(self, world_size, rank)
        self._col, self._group = col, "default"


def small_model():
    fix_random_seed(0)
    model = chain(Relu(6), Softmax(3))
    model.initialize(X=np.zeros((2, 5), np.float32), Y=np.zeros((2, 3), np.float32))
    return model


def per_rank_gradients(model, rank):
    """Different on each rank; summed, the larger arrays' norms pass thinc's grad_clip of 1.0
    and the biases' stay below it (where a mean instead of a sum shows)."""
    generator = np.random.default_rng(rank)
    return {(position, name): generator.normal(0, 0.25, node.get_param(name).shape)
            .astype(np.float32)
            for position, node in enumerate(model.walk()) for name in node.param_names}


OPTIMIZERS = {
    # Adam barely notices a gradient's scale; plain SGD shows any clipping that is wrong.
    "adam": lambda: Adam(0.01, L2=0.01, grad_clip=1.0, use_averages=False),
    "sgd": lambda: SGD(0.1, L2=0.01, grad_clip=1.0, use_averages=False),
    "adam-averages": lambda: Adam(0.01, L2=0.01, grad_clip=1.0, use_averages=True),
}


def averages_vector(model, averages):
    """The optimizer's moving averages of ``model``'s arrays, in walk order."""
    return np.concatenate([np.asarray(averages[(node.id, name)]).ravel()
                           for node in model.walk() for name in node.param_names])


def reference_update(steps, make_optimizer):
    """thinc's own optimizer, per array, on the sum of the two ranks' gradients."""
    model, optimizer = small_model(), make_optimizer()
    for _ in range(steps):
        total = {key: a + b for (key, a), b in zip(
            per_rank_gradients(model, 0).items(), per_rank_gradients(model, 1).values())}
        for position, node in enumerate(model.walk()):
            for name in node.param_names:
                param, _ = optimizer((node.id, name), node.get_param(name).copy(),
                                     total[(position, name)].copy())
                node.set_param(name, param)
    averages = averages_vector(model, optimizer.averages) if optimizer.averages else None
    return parameter_vector(model), averages


@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("exchange_class", [exchanges.AllreduceExchange,
                                            exchanges.ReduceScatterExchange])
def test_an_exchange_updates_like_thincs_optimizer_on_the_summed_gradient(exchange_class,
                                                                        optimizer_name):
    steps = 3
    models = [small_model(), small_model()]

    def body(rank):
        model = models[rank]
        optimizer = OPTIMIZERS[optimizer_name]()
        communicator = JoinedCommunicator(2, rank)
        extra = (1,) if exchange_class is exchanges.ReduceScatterExchange else ()
        exchange = exchange_class(optimizer, model, communicator, *extra)
        for _ in range(steps):
            for (position, name), gradient in per_rank_gradients(model, rank).items():
                list(model.walk())[position].inc_grad(name, gradient)
            model.finish_update(exchange)
            exchange.step_schedules()
        exchange.gather_averages()
        averages = averages_vector(model, exchange.averages) if exchange.averages else None
        return parameter_vector(model), averages

    results = run_ranks(2, body)
    weights, averages = reference_update(steps, OPTIMIZERS[optimizer_name])
    assert np.array_equal(results[0][0], results[1][0])
    np.testing.assert_allclose(results[0][0], weights, rtol=2e-5, atol=1e-6)
    assert not np.allclose(results[0][0], parameter_vector(small_model()))
    if averages is None:
        assert results[0][1] is None
    else:
        np.testing.assert_allclose(results[0][1], averages, rtol=2e-5, atol=1e-6)


# ------------------------------------------------------------------ tiny runs on Ray


def test_one_worker_prints_spacy_trains_own_table(ray_session, config_path, tmp_path):
    theirs = spacy_cli("train", str(config_path), "--training.max_steps", "8")
    ours = spacy_cli("ray-collective", "train", str(config_path), "--n-workers", "1",
                     "--training.max_steps", "8")
    assert theirs.exit_code == 0 and ours.exit_code == 0, ours.output
    assert len(table(theirs.output)) == 2
    assert table(ours.output) == table(theirs.output)


def test_two_workers_through_the_cli_learn_and_save_a_pipeline_that_tags(
        ray_session, config_path, tmp_path):
    output = tmp_path / "trained"
    result = spacy_cli("ray-collective", "train", str(config_path), "--n-workers", "2",
                       "--strategy", "allreduce", "--output", str(output))
    assert result.exit_code == 0, result.output
    rows = table(result.output)
    assert [int(row[1]) for row in rows] == [0, 8, 16, 24]
    assert rows[-1][3] < rows[1][3], "the ner loss did not fall"
    assert rows[-1][4] > 20.0, "the dev F-score stayed low"
    nlp = spacy.load(output / "model-last")
    assert nlp.pipe_names == ["tok2vec", "ner"]
    doc = nlp("Maria Lopez paid $500 to Acme Corp in Paris on March 3, 2020.")
    assert {entity.label_ for entity in doc.ents} & set(corpus.LABELS)
    assert (output / "model-best").is_dir()


@pytest.fixture(scope="module")
def pool(ray_session):
    workers = _driver().start_workers(RunSettings("allreduce", 2))
    yield workers
    for worker in workers:
        ray_session.kill(worker)


@pytest.mark.parametrize("strategy", ["allreduce", "reducescatter"])
def test_every_worker_holds_the_same_weights_after_every_update(
        ray_session, pool, config_path, strategy):
    settings = RunSettings(strategy, 2, record_digests=True, timeout_s=120)
    result = _driver().train(load_config(config_path, interpolate=False), settings,
                          workers=pool)
    first, second = result.reports
    assert first.steps == second.steps == STEPS + 1
    assert first.digests == second.digests
    assert len(set(first.digests)) == STEPS + 1, "some update left the weights unchanged"
    assert first.communication_seconds > 0 and first.bus_bytes > 0
    assert result.rows[-1]["other_scores"]["ents_f"] > 0.2


def test_the_parameter_server_trains_and_accounts_for_every_gradient(
        ray_session, pool, config_path):
    settings = RunSettings("parameter-server", 2, timeout_s=120)
    result = _driver().train(load_config(config_path, interpolate=False), settings,
                          workers=pool)
    reports = result.reports
    assert reports[0].steps == STEPS + 1
    assert all(report.actor_calls > 0 and report.bus_bytes == 0 for report in reports)
    # Every gradient sent to an owner was either used or dropped as stale.
    produced = sum(r.grads_accepted + r.grads_dropped for r in reports)
    assert produced > 0 and sum(r.grads_dropped for r in reports) < produced
    assert result.rows[-1]["other_scores"]["ents_f"] > 0.2


# ------------------------------------------------------------------ the benchmark's tables


def fake_run(strategy, workers, seconds, kind="scaling", ents_f=0.9, seed=0, batch=32):
    return {"kind": kind, "variant": strategy, "workers": workers, "steps": 100, "seed": seed,
            "per_worker_batch": batch, "seconds": seconds, "compute_s_per_update": 0.1,
            "communication_s_per_update": 0.02 if strategy != "parameter-server" else 0.08,
            "serve_s_per_update": 0.02 if strategy == "parameter-server" else 0.0,
            "evaluation_s": 1.0, "bus_bytes_per_update": 1e6, "actor_calls_per_update": 0.0,
            "stale_share": 0.0, "ents_f": ents_f, "parameters": 1000}


def test_the_benchmark_joins_parts_and_computes_speedup_scalability_and_targets():
    from benchmarks import spacy_train
    from benchmarks.param_server import join_documents
    meta = {"date": "2026-11-26", "ray": "2.60.0"}
    part1 = {"meta": meta, "runs": [fake_run("parameter-server", 1, 10.0),
                                    fake_run("allreduce", 1, 8.0)]}
    part2 = {"meta": meta, "runs": [
        fake_run("parameter-server", 2, 30.0), fake_run("allreduce", 2, 10.0),
        fake_run("allreduce", 1, 40.0, kind="accuracy", ents_f=0.80, batch=64),
        fake_run("allreduce", 2, 12.0, kind="accuracy", ents_f=0.795)]}
    text = spacy_train.tables(join_documents([part1, part2]))
    assert "| 2 | 3.00x |" in text                        # speed-up: 30 / 10
    assert "| 2 | 0.67 | 1.60 |" in text                  # n·T1/Tn: 2·10/30, 2·8/10
    assert "| 2 | 5.0x |" in text                         # (0.08 + 0.02) / 0.02
    assert "| allreduce | 2 | 32 | 79.50 | -0.50 |" in text
    with pytest.raises(ValueError, match="two parts ran"):
        join_documents([part1, part1])
    accuracy_only = {"meta": meta, "runs": part2["runs"][2:]}
    text = spacy_train.tables(accuracy_only)
    assert "Runtime" not in text and "| allreduce | 2 | 32 | 79.50 | -0.50 |" in text
    # Each group is compared with the one worker that took its whole batch, not the first.
    larger = {"meta": meta, "runs": [
        fake_run("allreduce", 1, 50.0, kind="accuracy", ents_f=0.90, batch=128),
        fake_run("parameter-server", 4, 60.0, kind="accuracy", ents_f=0.85)]}
    text = spacy_train.tables(join_documents([accuracy_only, larger]))
    assert "| allreduce | 2 | 32 | 79.50 | -0.50 |" in text
    assert "| parameter-server | 4 | 32 | 85.00 | -5.00 |" in text
    assert "| allreduce | 1 | 128 | 90.00 | +0.00 |" in text


def test_the_benchmark_records_the_command_that_reruns_it(tmp_path, monkeypatch):
    """``main(argv)`` goes through ``run_all`` (with nothing to train: no updates asked) and
    the JSON keeps the ``python -m`` line of its own arguments."""
    pytest.importorskip("ray", reason="spaCy's command line loads the driver, which imports Ray")
    import ray

    from benchmarks import spacy_train
    monkeypatch.setattr(ray, "init", lambda *args, **kwargs: None)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(spacy_train, "tables", lambda document: "")
    monkeypatch.setattr(sys, "argv", ["/somewhere/spacy_train.py", "--other"])
    path = tmp_path / "run.json"
    arguments = ["--workers", "1", "--steps", "0", "--train-sentences", "4",
                 "--dev-sentences", "2", "--json", str(path)]
    assert spacy_train.main(arguments) == 0
    document = json.loads(path.read_text())
    assert document["runs"] == []
    assert document["meta"]["command"] == " ".join(["python -m benchmarks.spacy_train",
                                                     *arguments])
    assert document["meta"]["spacy"] == spacy.__version__


FAILING_READER = '''
import threading
import spacy
from spacy.training import Corpus


@spacy.registry.readers("test_fails_on_rank_1.v1")
def fails_on_rank_1(path):
    """spaCy's reader, but in a worker's training thread example 1 (rank 1's first) is no
    Example: nlp.update raises there, on rank 1 only."""
    corpus = Corpus(path)

    def read(nlp):
        for index, example in enumerate(corpus(nlp)):
            training = threading.current_thread().name == "spacy-training"
            yield "not an example" if training and index == 1 else example
    return read
'''


def test_a_worker_that_fails_ends_the_run_at_once_naming_its_rank(
        ray_session, pool, config_path, corpus_dir, tmp_path):
    code = tmp_path / "reader.py"
    code.write_text(FAILING_READER)
    config = load_config(config_path, interpolate=False)
    config["corpora"]["train"] = {"@readers": "test_fails_on_rank_1.v1",
                                  "path": str(corpus_dir / "train.spacy")}
    import_code(code)
    timeout = 120
    settings = RunSettings("allreduce", 2, code_path=str(code), timeout_s=timeout)
    started = time.monotonic()
    with pytest.raises(_driver().TrainingFailedError,
                       match=r"^rank 1 failed in spaCy's training loop \(rank 0 stopped because "
                             r"of it\); rank 1's traceback:\n") as raised:
        _driver().train(config, settings, workers=pool)
    assert time.monotonic() - started < timeout / 2, "rank 0 waited for its deadline"
    assert "AttributeError" in str(raised.value)
    assert [(f.rank, f.in_collective) for f in raised.value.failures] == [(0, True), (1, False)]


def test_a_failed_run_names_the_ranks_that_failed_first_whatever_their_order():
    own = WorkerFailure(2, False, "Traceback: ValueError: bad batch\n")
    followers = [WorkerFailure(0, True, "Traceback: RankFailedError\n"),
                 WorkerFailure(1, True, "Traceback: RankFailedError\n")]
    error = _driver().TrainingFailedError(followers + [own])
    assert str(error) == ("rank 2 failed in spaCy's training loop (ranks 0, 1 stopped because "
                          "of it); rank 2's traceback:\nTraceback: ValueError: bad batch\n")
    timeouts = _driver().TrainingFailedError(followers)
    assert str(timeouts).startswith("ranks 0, 1 failed in a collective; rank 0's traceback:\n")

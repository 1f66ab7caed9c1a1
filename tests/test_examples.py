"""Every script in ``examples/`` runs as docs/examples.md says (``python examples/<name>.py``) and
prints what numpy says it must, so that the examples cannot rot. The parameter-server
example is ``tests/test_param_server.py``'s. Each Ray example starts a Ray of its own in its
subprocess (marked ``ray``); the NCCL examples need GPUs, and where the Ray they start has too
few they must say so and exit with status 1."""

import ast

import numpy as np
import pytest

from support.helpers import run_python

TIMEOUT_S = 240


def _run(script, *arguments, status=0):
    finished = run_python([f"examples/{script}", *arguments], TIMEOUT_S)
    assert finished.returncode == status, finished.stdout[-2000:] + finished.stderr[-3000:]
    return finished.stdout.splitlines()


def _after(lines, prefix):
    """The text after ``prefix`` on the one line that starts with it."""
    [line] = [line for line in lines if line.startswith(prefix)]
    return line[len(prefix):].strip()


def _printed_array(text):
    """A numpy array as ``print`` shows it (``[3. 3. 3.]``)."""
    return np.array(text.strip("[]").split(), float)


def test_local_allreduce_runs_four_thread_ranks():
    lines = _run("local_allreduce.py")
    assert "rank 1 received 42 from rank 0" in lines
    for rank in range(4):
        result = ast.literal_eval(_after(lines, f"rank {rank}:"))
        assert result == {"average": [np.mean([1.0, 2.0, 3.0, 4.0])] * 3,
                          "weights": [0.0, 1.0, 2.0], "allgather": [0, 10, 20, 30]}


@pytest.mark.ray
def test_imperative_allreduce_averages_broadcasts_and_gathers():
    lines = _run("imperative_allreduce.py")
    assert ast.literal_eval(_after(lines, "joined ranks:")) == [0, 1, 2, 3]
    results = [ast.literal_eval(line) for line in lines if line.startswith("{")]
    assert results == [{"rank": rank, "mean gradient": np.mean([1.0, 2.0, 3.0, 4.0]),
                        "weights": [0.0, 1.0, 2.0, 3.0], "allgather": [0, 1, 2, 3]}
                       for rank in range(4)]


@pytest.mark.ray
def test_declarative_allreduce_sums_two_actors_buffers():
    lines = _run("declarative_allreduce.py")
    for rank in range(2):
        assert ast.literal_eval(_after(lines, f"rank {rank}:")) == [1.0 + 1.0] * 10


@pytest.mark.ray
def test_declarative_refs_chain_two_calls_and_a_send():
    lines = _run("declarative_refs.py")
    total = np.full(10, 1.0 + 2.0)
    np.testing.assert_array_equal(_printed_array(_after(lines, "sum, rank 0:")), total)
    np.testing.assert_array_equal(_printed_array(_after(lines, "sum then max, rank 1:")),
                                  total)
    np.testing.assert_array_equal(
        _printed_array(_after(lines, "rank 1 received from rank 0:")), np.full(10, 1.0))


@pytest.mark.ray
def test_send_recv_keeps_tagged_messages_apart():
    lines = _run("send_recv.py")
    assert f"rank 0 got the reply {sum(range(5))}" in lines
    assert "rank 1 got [0, 1, 2, 3, 4] (tag 1) and [2.5, 2.5, 2.5] (tag 2)" in lines


@pytest.mark.ray
@pytest.mark.parametrize("script, arguments, needed", [
    ("nccl_allreduce.py", (), 2), ("nccl_multigpu.py", ("--actors", "1"), 2)])
def test_nccl_examples_say_what_they_need_without_enough_gpus(script, arguments, needed):
    finished = run_python([f"examples/{script}", *arguments], TIMEOUT_S)
    if finished.returncode == 0:  # a GPU machine: the example ran
        assert finished.stdout.strip(), finished.stderr[-3000:]
        return
    assert finished.returncode == 1, finished.stderr[-3000:]
    assert f"this example needs {needed} GPUs in the Ray cluster; it has " in finished.stdout


@pytest.mark.ray
def test_elastic_training_loses_a_worker_takes_a_fresh_one_and_learns_as_if_undisturbed():
    from support import extras
    extras.need("thinc", "the elastic training example")
    extras.need("sklearn", "the elastic training example")
    lines = _run("elastic_training.py")
    assert _after(lines, "phase 2:").startswith("worker 2 killed; the others stopped with "
                                                "['PeerDiedError']; shrunk to ranks "
                                                "{0: 0, 1: 1, 3: 2}")
    assert _after(lines, "phase 3:").startswith("a fresh actor joined; 4 workers go on")
    losses = [float(_after(lines, f"mean loss, phase {k}:")) for k in (1, 2, 3)]
    assert losses[0] > losses[1] > losses[2], losses
    elastic = float(_after(lines, "accuracy, elastic run:"))
    reference = float(_after(lines, "accuracy, undisturbed run:"))
    assert abs(elastic - reference) <= 0.01 and reference > 0.9, (elastic, reference)
    assert _after(lines, "the workers' parameters are identical:") == "True"


@pytest.mark.ray
def test_weight_sync_delivers_every_version_to_every_engine_including_a_newcomer():
    lines = _run("weight_sync.py")
    versions = [line for line in lines if line.startswith("version ")]
    assert len(versions) == 6
    for version, line in enumerate(versions, start=1):
        engines = 4 if version < 4 else 5
        assert line == (f"version {version}: delivered {[version] * engines} to {engines} "
                        f"engines, answers match the trainer's: True")


@pytest.mark.ray
def test_jax_collectives_average_and_gather_immutable_arrays_as_new_ones():
    lines = _run("jax_collectives.py")
    assert ast.literal_eval(_after(lines, "joined ranks:")) == [0, 1, 2, 3]
    results = [ast.literal_eval(line) for line in lines if line.startswith("{")]
    assert results == [{"rank": rank, "in-place refused": "yes",
                        "mean gradient": np.mean([1.0, 2.0, 3.0, 4.0]),
                        "input unchanged": rank + 1.0,
                        "allgather": [[r, 10 * r] for r in range(4)],
                        "result type": "ArrayImpl"}
                       for rank in range(4)]


@pytest.mark.ray
def test_torch_ddp_trains_on_two_actors_with_the_ray_collective_backend():
    lines = _run("torch_ddp.py")
    for rank in range(2):
        first, last = _after(lines, f"rank {rank}: loss").split(" -> ")
        assert float(last) < float(first) / 10
    assert _after(lines, "parameters equal on every rank:") == "True"

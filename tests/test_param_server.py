"""The parameter-server example: spacy-ray's sharded server and its collective replacements.

A tiny version of every variant (a small MLP, 2 workers, a few updates) on real actors, against
references that share none of the communication code: one process training on the global batch
with thinc's own update (the synchronous variants must match it), exact accounting of every
gradient the asynchronous server produced, and bitwise agreement of the collective variants'
weights across workers after every step. The server's rules (stale drop, update after
``grads_per_update`` gradients, parameters pushed to every other worker, the synchronous wait
and its timeout) are also checked in-process with recording stand-ins for the peer actors.
"""

import json
import sys

import numpy as np
import pytest

from support import extras

extras.need("thinc", "the parameter-server example")
extras.need("sklearn", "the parameter-server example")

from examples.parameter_server import collective_variants as cv  # noqa: E402
from examples.parameter_server.task import (BatchStream, TaskConfig, build_model,  # noqa: E402
                                            load_digits, loss_and_gradients, make_optimizer)
from ray_collective.integrations.thinc.parameter_server import PeerProxy, divide_keys  # noqa: E402
from ray_collective.integrations.thinc.params import parameter_keys, parameter_nodes  # noqa: E402
from examples.parameter_server.training import (VARIANTS, RunOptions, run_variant,  # noqa: E402
                                                start_workers)

WORKERS = 2
STEPS = 6
TINY = TaskConfig(width=32, depth=2, per_worker_batch=16, learn_rate=0.01, seed=3)
COLLECTIVE_VARIANTS = [name for name, v in VARIANTS.items() if v.scheme not in ("ps", "local")]


@pytest.fixture(scope="module")
def digits():
    return load_digits()


@pytest.fixture(scope="module")
def pool(ray_session):
    """Two worker actors shared by every run of this module (each run starts afresh)."""
    workers = start_workers(WORKERS)
    yield workers
    for worker in workers:
        ray_session.kill(worker)


def single_process_reference(digits, steps):
    """What one process computes on the same global batches: thinc's own update, no proxy."""
    model = build_model(TINY, digits)
    optimizer = make_optimizer(TINY)
    trainer = cv.LocalTrainer(model, optimizer)
    global_batch = TINY.per_worker_batch * WORKERS
    stream = BatchStream(len(digits.train_x), global_batch, TINY.seed)
    for step in range(steps):
        rows = stream.rows(step, 0, global_batch)
        trainer.step(step, digits.train_x[rows], digits.train_y[rows])
    return trainer.parameters()


def run(variant, digits, pool, steps=STEPS, record=True):
    options = RunOptions(variant, WORKERS, steps, TINY, record_digests=record, timeout_s=120)
    return run_variant(options, digits, pool)


# ------------------------------------------------------------------ the task


def test_workers_take_disjoint_slices_of_each_global_batch_and_epochs_are_permutations():
    stream = BatchStream(train_size=10, global_batch=4, seed=1)
    for step in range(5):
        slices = [stream.rows(step, rank * 2, 2) for rank in range(2)]
        assert not set(slices[0]) & set(slices[1])
        assert np.array_equal(np.concatenate(slices), stream.rows(step, 0, 4))
    first_epoch = np.concatenate([BatchStream(10, 5, 1).rows(step, 0, 5) for step in range(2)])
    assert sorted(first_epoch) == list(range(10))


def test_the_default_model_has_a_million_parameters_in_nine_nodes(digits):
    model = build_model(TaskConfig(), digits)
    assert len(parameter_nodes(model)) == 9
    assert sum(node.get_param(name).size for _, node in parameter_nodes(model)
               for name in node.param_names) == 1_063_690


def test_divide_keys_gives_whole_nodes_and_the_remainder_to_the_last_worker(digits):
    model = build_model(TaskConfig(width=8, depth=8), digits)
    nodes = [position for position, _ in parameter_nodes(model)]
    two = divide_keys(model, 2)
    assert [sorted({p for p, _ in keys}) for keys in two] == [nodes[:4], nodes[4:]]
    sixteen = divide_keys(model, 16)
    assert [len({p for p, _ in keys}) for keys in sixteen] == [1] * 9 + [0] * 7
    assert sorted(key for keys in sixteen for key in keys) == sorted(parameter_keys(model))


# ------------------------------------------------------------------ the server's rules, in-process


class Recorder:
    """A stand-in for a peer actor: records each ``method.remote(...)`` call."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, method):
        recorder = self

        class Method:
            @staticmethod
            def remote(*args):
                recorder.calls.append((method, args))
        return Method


def owner_proxy(digits, synchronous=False, timeout_s=5.0):
    """Rank 0 of two: a proxy installed in a tiny model, with a recording peer."""
    model = build_model(TINY, digits)
    peer = Recorder()
    owned = divide_keys(model, 2)
    proxy = PeerProxy(model, 0, [None, peer], owned, make_optimizer(TINY),
                      grads_per_update=2, synchronous=synchronous, timeout_s=timeout_s)
    proxy.install(model)
    return model, proxy, peer, owned


def test_owner_drops_stale_gradients_updates_after_two_and_pushes_to_the_other_worker(digits):
    model, proxy, peer, owned = owner_proxy(digits)
    key = owned[0][0]
    node = dict(parameter_nodes(model))[key[0]]
    before = node.get_param(key[1]).copy()
    gradient = np.ones_like(before)
    proxy.receive_grad(key, 0, gradient)
    assert proxy.counters.grads_dropped == 1
    proxy.receive_grad(key, 1, gradient)
    assert np.array_equal(node.get_param(key[1]), before)
    proxy.receive_grad(key, 1, 3 * gradient)
    after = node.get_param(key[1])
    assert proxy.counters.updates[key] == 1
    assert np.all(after < before)
    assert [(method, args[:2]) for method, args in peer.calls] == [("set_param", (key, 2))]
    assert peer.calls[0][1][2] is after
    proxy.receive_grad(key, 1, gradient)
    assert proxy.counters.grads_dropped == 2


def test_gradients_of_arrays_owned_elsewhere_are_one_call_each_to_the_owner(digits):
    model, proxy, peer, owned = owner_proxy(digits)
    stream = BatchStream(len(digits.train_x), 16, 0)
    rows = stream.rows(0, 0, 16)
    loss_and_gradients(model, digits.train_x[rows], digits.train_y[rows])
    pushed = [(args[0], args[1]) for method, args in peer.calls if method == "inc_grad"]
    assert sorted(pushed) == sorted((key, 1) for key in owned[1])
    assert proxy.counters.actor_calls == len(owned[1])


def test_a_synchronous_worker_waiting_for_a_silent_owner_times_out_naming_the_array(digits):
    model, proxy, _, owned = owner_proxy(digits, synchronous=True, timeout_s=0.2)
    node = dict(parameter_nodes(model))[owned[1][0][0]]
    proxy.begin_step(1)
    with pytest.raises(TimeoutError, match=r"rank 0: array .* still at version 1"):
        node.get_param(owned[1][0][1])


# ------------------------------------------------------------------ every variant on real actors


@pytest.mark.parametrize("variant", COLLECTIVE_VARIANTS)
def test_collective_variant_matches_one_process_and_workers_agree_bit_for_bit(
        variant, digits, pool):
    result = run(variant, digits, pool)
    first, second = result.reports
    assert first.digests == second.digests and len(first.digests) == STEPS
    assert first.losses[-1] < first.losses[0]
    np.testing.assert_allclose(first.final_parameters, single_process_reference(digits, STEPS),
                               rtol=1e-4, atol=1e-5)
    assert first.actor_calls == 0 and first.bus_bytes > 0


def test_synchronous_server_matches_one_process_and_drops_nothing(digits, pool):
    result = run("ps-sync", digits, pool)
    first, second = result.reports
    assert first.final_digest == second.final_digest
    np.testing.assert_allclose(first.final_parameters, single_process_reference(digits, STEPS),
                               rtol=1e-4, atol=1e-5)
    assert first.losses[-1] < first.losses[0]
    arrays = len(parameter_keys(build_model(TINY, digits)))
    assert sum(r.grads_dropped for r in result.reports) == 0
    assert sum(r.grads_accepted for r in result.reports) == STEPS * WORKERS * arrays
    updates = [n for r in result.reports for n in r.updates_per_key.values()]
    assert updates == [STEPS] * arrays


def test_asynchronous_server_learns_and_accounts_for_every_gradient(digits, pool):
    steps = 80
    result = run("ps-async", digits, pool, steps=steps, record=False)
    arrays = len(parameter_keys(build_model(TINY, digits)))
    produced = steps * WORKERS * arrays
    used = sum(r.grads_accepted for r in result.reports)
    dropped = sum(r.grads_dropped for r in result.reports)
    assert used + dropped == produced
    assert sum(sum(r.updates_per_key.values()) for r in result.reports) <= used // 2
    # Stale views make its losses erratic; its weights still learn: chance is 10 %. After 30
    # steps runs scored 19-68 % (the low end under load, when more gradients go stale); after
    # 80 steps (0.6 s) eight runs, some beside three busy processes, scored 78-89 %.
    assert result.reports[0].final_accuracy > 0.3


def test_run_options_and_pool_size_are_checked(pool, digits):
    with pytest.raises(ValueError, match="unknown variant 'nope'"):
        RunOptions("nope", 2, 1)
    with pytest.raises(ValueError, match="local variant runs one worker"):
        RunOptions("local", 2, 1)
    with pytest.raises(ValueError, match="3 workers asked for, the pool has 2"):
        run_variant(RunOptions("allreduce-flat", 3, 1, TINY), digits, pool)


# ------------------------------------------------------------------ the benchmark's tables


def fake_run(kind, variant, workers, seconds, **fields):
    run = {"kind": kind, "variant": variant, "workers": workers, "steps": 10, "seed": 0,
           "per_worker_batch": 16, "seconds": seconds, "compute_s_per_update": 0.01,
           "communication_s_per_update": 0.002, "serve_s_per_update": 0.0,
           "bus_bytes_per_update": 1024.0, "actor_bytes_per_update": 0.0,
           "actor_calls_per_update": 0.0, "grads_accepted": 0, "grads_dropped": 0,
           "stale_share": 0.0, "updates_per_key_per_step": None, "final_accuracy": 0.9,
           "accuracy_curve": [[5, 0.5, 0.8], [10, 1.0, 0.96]], "first_loss": 2.3,
           "last_loss": 0.5, "parameters": 1000}
    run.update(fields)
    return run


def test_benchmark_tables_compute_speedup_scalability_and_time_to_accuracy(tmp_path):
    from benchmarks import param_server
    server = dict(communication_s_per_update=0.02, serve_s_per_update=0.01,
                  actor_calls_per_update=6.0, actor_bytes_per_update=2 * 2**20,
                  stale_share=0.25, updates_per_key_per_step=0.75)
    runs = [fake_run("scaling", "ps-async", 1, 2.0), fake_run("scaling", "ps-async", 1, 2.0),
            fake_run("scaling", "ps-async", 2, 8.0, **server),
            fake_run("scaling", "ps-async", 2, 8.0, **server),
            fake_run("scaling", "allreduce-flat", 1, 1.0),
            fake_run("scaling", "allreduce-flat", 1, 1.0),
            fake_run("scaling", "allreduce-flat", 2, 1.5),
            fake_run("scaling", "allreduce-flat", 2, 2.5),
            fake_run("accuracy", "local", 1, 1.0, final_accuracy=0.95),
            fake_run("accuracy", "allreduce-flat", 2, 1.0, final_accuracy=0.94,
                     accuracy_curve=[[5, 0.4, 0.5], [10, 0.9, 0.94]])]
    document = {"meta": {"date": "d", "ray": "r", "thinc": "t", "numpy": "n", "cpus": 2,
                         "options": {"target_accuracy": 0.95, "accuracy_global_batch": 32,
                                     "accuracy_steps": 10, "eval_every": 5}},
                "runs": runs}
    text = param_server.report(document)
    assert "| 2 | 8.00 ± 0.00 | 2.00 ± 0.71 |" in text          # runtime, mean ± std
    assert "| 2 | 4.00x |" in text                              # speed-up 8.0 / 2.0
    assert "| 2 | 0.50 | 1.00 |" in text                        # n·T1/Tn: 2*2/8, 2*1/2
    assert "| 2 | ps-async | 10.0 | 20.0 | 10.0 | 2.00 MiB | 6.0 | 25.0 % | 0.75 |" in text
    assert "| 2 | 15.0x |" in text                              # (20 + 10) ms / 2 ms
    assert "| local | 1 | 95.00 ± 0.00 | +0.00 | 88.00 ± 0.00 | +0.00 | 1.00 | 1/1 |" in text
    assert ("| allreduce-flat | 2 | 94.00 ± 0.00 | -1.00 | 72.00 ± 0.00 | -16.00 | not reached "
            "| 0/1 |") in text
    path = tmp_path / "run.json"
    path.write_text(json.dumps(document))
    assert param_server.main(["--from-json", str(path), "--plot", str(tmp_path / "t.png"),
                              "--markdown", str(tmp_path / "t.md")]) == 0
    assert (tmp_path / "t.png").stat().st_size > 0
    assert (tmp_path / "t.md").read_text().startswith("Measured d")


def test_a_table_run_in_parts_is_joined_and_parts_that_do_not_fit_are_refused(tmp_path):
    from benchmarks import param_server
    meta = {"ray": "r", "thinc": "t", "numpy": "n", "cpus": 2,
            "options": {"target_accuracy": 0.95, "accuracy_global_batch": 32,
                        "accuracy_steps": 10, "eval_every": 5}}
    first = {"meta": dict(meta, date="day 1", load_average=[1.0, 1.0, 1.0]),
             "runs": [fake_run("scaling", "ps-async", 1, 2.0, seed=0),
                      fake_run("scaling", "ps-async", 2, 8.0, seed=0)]}
    second = {"meta": dict(meta, date="day 2"),
              "runs": [fake_run("scaling", "ps-async", 1, 4.0, seed=1),
                       fake_run("accuracy", "local", 1, 1.0, final_accuracy=0.95)]}
    paths = []
    for number, document in enumerate([first, second]):
        paths.append(tmp_path / f"part{number}.json")
        paths[-1].write_text(json.dumps(document))
    markdown = tmp_path / "t.md"
    assert param_server.main(["--from-json", ",".join(map(str, paths)),
                              "--markdown", str(markdown)]) == 0
    text = markdown.read_text()
    assert text.startswith("Measured day 1 (load average at the end 1.0, 1.0, 1.0); day 2:")
    assert "over 1–2 trials" in text
    assert "| 1 | 3.00 ± 1.41 |" in text and "| 2 | 8.00 ± 0.00 |" in text
    assert "| local | 1 | 95.00 ± 0.00 |" in text
    with pytest.raises(ValueError, match="ps-async at 1 workers, trial 0"):
        param_server.join_documents([first, first])
    longer = {"meta": first["meta"], "runs": [fake_run("scaling", "ps-async", 4, 1.0,
                                                       steps=100)]}
    with pytest.raises(ValueError, match="differ in"):
        param_server.join_documents([first, longer])


def test_the_first_trial_option_numbers_the_trials_and_their_seeds():
    from benchmarks import param_server
    args = param_server.build_parser().parse_args(
        ["--first-trial", "2", "--trials", "1", "--workers", "2", "--variants", "ps-async",
         "--accuracy-steps", "0"])
    assert [(kind, options.task.seed) for kind, options in param_server._plan(args)] == [
        ("scaling", 2)]


def test_a_run_records_the_command_that_reruns_it(tmp_path, monkeypatch):
    """``main(argv)`` hands ``run_all`` the ``python -m`` line of its own arguments (not the
    path of the script, nor the caller's ``sys.argv``), which the JSON keeps."""
    from benchmarks import param_server
    seen = {}

    def fake_run_all(args, command):
        seen["command"] = command
        return {"meta": {"command": command}, "runs": []}

    monkeypatch.setattr(param_server, "run_all", fake_run_all)
    monkeypatch.setattr(param_server, "report", lambda document: "")
    monkeypatch.setattr(sys, "argv", ["/somewhere/param_server.py", "--other"])
    path = tmp_path / "run.json"
    arguments = ["--workers", "1,2", "--json", str(path)]
    assert param_server.main(arguments) == 0
    expected = " ".join(["python -m benchmarks.param_server", *arguments])
    assert seen["command"] == expected
    assert json.loads(path.read_text())["meta"]["command"] == expected

"""The agent/observer benchmark: argument parsing, metrics, the ratio to torch.distributed.rpc,
and actions equal to the policy's for every backend (torch-rpc included)."""

import numpy as np
import pytest

from benchmarks import agent_observer as ao


def test_parse_options_reads_comma_separated_sweeps():
    options, json_path = ao.parse_options(
        ["--world-size", "2,4", "--batch", "true,false", "--backend", "ray-actors,torch-rpc",
         "--iterations", "7", "--warmup", "0", "--state-size", "10", "--json", "out.json"])
    assert options.world_sizes == (2, 4)
    assert options.batch_modes == (True, False)
    assert options.backends == ("ray-actors", "torch-rpc")
    assert ao.parse_options([])[0].backends == ("ray", "ray-actors", "torch-rpc")
    assert (options.iterations, options.warmup, options.state_size) == (7, 0, 10)
    assert json_path == "out.json"


@pytest.mark.parametrize("argv", [["--world-size", "1"], ["--world-size", "two"],
                                  ["--batch", "maybe"], ["--backend", "gloo"],
                                  ["--iterations", "0"], ["--timeout", "-1"]])
def test_bad_arguments_exit_with_status_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        ao.parse_options(argv)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err


def test_summarize_computes_throughput_from_latency():
    record = ao.ObserverRecord((0.5, 0.5), np.zeros((0, 4), np.float32), np.zeros(0, np.int64))
    metrics = ao.summarize([0.25, 0.25], [record, record], batch_size=2)
    assert metrics["agent_latency_s"]["p50"] == 0.25
    assert metrics["agent_throughput_rps"]["p95"] == 8.0
    assert metrics["observer_throughput_rps"]["p75"] == 2.0


def _point(backend, batch, world_size, observer_p50):
    metrics = {name: dict.fromkeys(("p50", "p75", "p90", "p95"), 1.0) for name in ao.METRICS}
    metrics["observer_latency_s"] = dict(metrics["observer_latency_s"], p50=observer_p50)
    return ao.PointResult(backend, batch, world_size, 1, metrics, (1.0,), ())


def test_observer_ratio_is_this_library_over_torch_rpc():
    pytest.importorskip("ray", reason="the observer benchmark's module imports Ray")
    results = [_point("ray", True, 5, 1e-3), _point("torch-rpc", True, 5, 4e-3),
               _point("ray", False, 5, 3e-3), _point("torch-rpc", False, 5, 2e-3),
               _point("ray", False, 17, 1e-3), _point("ray-actors", False, 17, 9e-3),
               ao.PointResult("torch-rpc", False, 17, 0, {}, (), (), "TimeoutError")]
    assert ao.observer_ratios(results) == pytest.approx({(True, 5): 0.25, (False, 5): 1.5})
    assert ao.format_ratios(results).splitlines() == [
        "observer p50 ray / torch-rpc, batch true, 4 observers: 0.25",
        "observer p50 ray / torch-rpc, batch false, 4 observers: 1.50"]
    document = ao.to_json(results, ao.AgentObserverOptions(), "cmd")
    assert document["observer_p50_ratios"][0] == {"batch": True, "world_size": 5,
                                                  "observers": 4, "ray_over_torch_rpc": 0.25}


def test_table_shows_errors_and_numbers():
    metrics = {name: dict.fromkeys(("p50", "p75", "p90", "p95"), 1.0) for name in ao.METRICS}
    good = ao.PointResult("ray", True, 2, 1, metrics, (1.0,), ())
    bad = ao.PointResult("ray-actors", False, 4, 0, {}, (), (), "TimeoutError: late")
    table = ao.format_table([good, bad])
    assert "1000.00" in table and "error: TimeoutError: late" in table


def test_tiny_run_serves_the_policy_actions(ray_session):
    options = ao.AgentObserverOptions(world_sizes=(2, 3), batch_modes=(True, False),
                                      backends=ao.BACKENDS, iterations=4, warmup=1,
                                      state_size=4, timeout_s=60.0, record_iterations=4)
    results = ao.run_benchmark(options)
    assert [(r.world_size, r.backend, r.batch) for r in results] == [
        (w, b, m) for w in (2, 3) for b in ao.BACKENDS for m in (True, False)]
    policy = ao.make_policy(options.state_size, options.actions, options.seed)
    for result in results:
        assert result.error is None, result.error
        assert len(result.observers) == result.world_size - 1
        for metric in ao.METRICS:
            values = result.metrics[metric].values()
            assert all(np.isfinite(v) and v > 0 for v in values), (metric, result)
        for rank, record in enumerate(result.observers, start=1):
            assert len(record.latencies_s) == options.iterations
            expected_states = np.stack([ao.observer_state(options.seed, rank, k + options.warmup,
                                                          options.state_size)
                                        for k in range(options.record_iterations)])
            np.testing.assert_array_equal(record.states, expected_states)
            np.testing.assert_array_equal(record.actions,
                                          ao.select_actions(policy, expected_states))


def test_json_document_has_metadata_and_rows():
    pytest.importorskip("ray", reason="the observer benchmark's module imports Ray")
    import json
    metrics = {name: dict.fromkeys(("p50", "p75", "p90", "p95"), 1.0) for name in ao.METRICS}
    record = ao.ObserverRecord((0.5,), np.zeros((0, 4), np.float32), np.zeros(0, np.int64))
    result = ao.PointResult("ray", False, 2, 1, metrics, (1.0,), (record,))
    document = json.loads(json.dumps(ao.to_json([result], ao.AgentObserverOptions(), "cmd")))
    assert document["metadata"]["command"] == "cmd" and document["metadata"]["torch"]
    assert document["rows"][0]["observer_latencies_s"] == [[0.5]]
    assert document["rows"][0]["agent_latency_s"]["p50"] == 1.0

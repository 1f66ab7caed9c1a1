"""The flight recorder: a rank's last calls on a group, in order, with their shapes and outcomes,
on both paths of a call (known shapes and the full path); the errors that break a group carry
them; its size is settable and 0 turns it off; its counts (what the metrics export) are exact,
also past the ring's size and past the folding of shapes. In-process groups (no Ray)."""

import numpy as np
import pytest

import ray_collective as col
from ray_collective import recorder as recorder_module
from ray_collective.errors import ArgumentValueError
from ray_collective.group import current_registry
from ray_collective.recorder import FlightRecorder, ObservingOptions
from ray_collective.testing import run_ranks


def _trace_of_mixed_calls(rank):
    x = np.arange(6, dtype=np.float32)
    for _ in range(3):
        col.allreduce(x)                         # known shape after the first
    col.broadcast(np.zeros((2, 3), np.int64), src_rank=1)
    gathered = [np.zeros(4, np.float64) for _ in range(2)]
    col.allgather(gathered, np.ones(4))          # the full path always
    col.barrier(timeout=30)                      # the full path: a timeout of its own
    return col.get_collective_trace()


def test_the_trace_holds_every_call_in_order_with_its_shape_and_outcome():
    traces = run_ranks(2, _trace_of_mixed_calls)
    for rank, trace in enumerate(traces):
        assert [(t["seq"], t["collective"]) for t in trace] == [
            (0, "allreduce"), (1, "allreduce"), (2, "allreduce"), (3, "broadcast"),
            (4, "allgather"), (5, "barrier")]
        assert [t["outcome"] for t in trace] == ["ok"] * 6
        first = trace[0]
        assert (first["dtype"], first["shape"], first["nbytes"]) == ("float32", [6], 24)
        assert trace[3]["dtype"] == "int64" and trace[3]["shape"] == [2, 3]
        assert trace[3]["nbytes"] == 48
        assert all(t["peers"] == [1 - rank] for t in trace)
        assert all(t["algorithm"] for t in trace)
        assert all(t["start"] <= t["end"] for t in trace)
        assert all(a["end"] <= b["start"] for a, b in zip(trace, trace[1:]))
        assert all(abs(t["end"] - t["start"] - t["duration_s"]) < 1e-6 for t in trace)


def test_the_trace_keeps_the_last_n_calls(monkeypatch):
    monkeypatch.setenv(recorder_module.TRACE_SIZE_VARIABLE, "5")

    def body(rank):
        x = np.zeros(3)
        for _ in range(12):
            col.allreduce(x)
        return col.get_collective_trace()

    for trace in run_ranks(2, body):
        assert [t["seq"] for t in trace] == [7, 8, 9, 10, 11]


def test_a_trace_size_of_zero_keeps_nothing(monkeypatch):
    monkeypatch.setenv(recorder_module.TRACE_SIZE_VARIABLE, "0")

    def body(rank):
        col.allreduce(np.zeros(3))
        return col.get_collective_trace(), current_registry().get("default").recorder

    for trace, recorder in run_ranks(2, body):
        assert trace == [] and recorder is None


@pytest.mark.parametrize("value", ["-1", "lots", str(recorder_module.MAX_TRACE_SIZE + 1)])
def test_a_malformed_trace_size_is_refused_before_joining(monkeypatch, value):
    monkeypatch.setenv(recorder_module.TRACE_SIZE_VARIABLE, value)
    refused = run_ranks(1, lambda rank: None, return_exceptions=True)[0]
    assert isinstance(refused, ArgumentValueError)
    assert recorder_module.TRACE_SIZE_VARIABLE in str(refused)


def test_a_malformed_metrics_switch_is_refused(monkeypatch):
    monkeypatch.setenv(recorder_module.METRICS_VARIABLE, "maybe")
    with pytest.raises(ArgumentValueError, match=recorder_module.METRICS_VARIABLE):
        ObservingOptions.from_environment()


@pytest.mark.parametrize("value, on", [("", True), ("1", True), ("0", False), ("off", False)])
def test_the_metrics_switch(monkeypatch, value, on):
    monkeypatch.setenv(recorder_module.METRICS_VARIABLE, value)
    assert ObservingOptions.from_environment().metrics is on


def test_a_timed_out_call_carries_the_trace_with_its_outcome():
    def body(rank):
        x = np.ones(2)
        col.allreduce(x)
        col.allreduce(x)
        if rank == 1:
            return None                          # never makes the third call
        try:
            col.allreduce(x, timeout=0.5)
        except col.CollectiveTimeoutError as err:
            return err
        return None

    error = run_ranks(2, body)[0]
    assert isinstance(error, col.CollectiveTimeoutError)
    assert [(t["seq"], t["outcome"]) for t in error.trace] == [
        (0, "ok"), (1, "ok"), (2, "CollectiveTimeoutError")]
    assert error.trace[-1]["duration_s"] >= 0.5


def test_a_mismatch_carries_the_trace_on_both_ranks():
    def body(rank):
        col.allreduce(np.ones(2))
        try:
            col.allreduce(np.ones(3 if rank else 2), timeout=10)
        except col.CollectiveError as err:
            return err
        return None

    for error in run_ranks(2, body):
        assert isinstance(error, col.CollectiveError)
        assert [t["outcome"] for t in error.trace][0] == "ok"
        assert error.trace[-1]["outcome"] == type(error).__name__


def test_the_later_broken_error_carries_the_cause_with_its_trace():
    def body(rank):
        if rank == 0:
            try:
                col.barrier(timeout=0.3)
            except col.CollectiveTimeoutError:
                pass
            try:
                col.barrier()
            except col.GroupBrokenError as err:
                return err
        return None

    broken = run_ranks(2, body)[0]
    assert isinstance(broken, col.GroupBrokenError)
    assert broken.cause.trace[-1]["outcome"] == "CollectiveTimeoutError"


def test_the_trace_and_error_travel_pickled_as_ray_sends_them():
    import pickle

    def body(rank):
        try:
            col.allreduce(np.ones(2), timeout=0.3) if rank == 0 else None
        except col.CollectiveTimeoutError as err:
            return err
        return None

    error = pickle.loads(pickle.dumps(run_ranks(2, body)[0]))
    assert error.trace[-1]["outcome"] == "CollectiveTimeoutError"


def _counting_recorder(size, on_fold=lambda: None):
    return FlightRecorder("g", 0, "local", size, True, on_fold)


def test_counts_are_exact_past_the_ring_and_the_histogram_sees_the_last_calls():
    recorder = _counting_recorder(4)
    small, large = recorder.shape("allreduce", "float32", (2,), 8), \
        recorder.shape("broadcast", "int64", (10,), 80)
    for seq in range(10):
        recorder.finished(small if seq % 3 else large, seq, 0.0)
    assert (small.calls, large.calls) == (6, 4)
    entries = recorder.entries()
    assert [entry[1] for entry in entries] == [6, 7, 8, 9]
    assert recorder.entries(entries[1]) == entries[2:]
    # an entry that left the ring: every entry kept is newer
    assert recorder.entries(("gone",)) == entries


def test_folding_keeps_every_count_and_drops_the_groups_caches(monkeypatch):
    monkeypatch.setattr(recorder_module, "MAX_SHAPES", 3)
    folds = []
    recorder = _counting_recorder(8, lambda: folds.append(True))
    shapes = [recorder.shape("allreduce", "float32", (n,), 4 * n) for n in (1, 2, 3)]
    for shape in shapes:
        recorder.finished(shape, 0, 0.0)
    shapes[0].flushed = 1                        # as if the metrics had read it
    fresh = recorder.shape("allreduce", "float32", (4,), 16)
    assert folds == [True]
    assert recorder.retired == {"allreduce": [2, 4 * 2 + 4 * 3]}
    assert recorder.shapes() == [fresh]


def test_a_failed_call_counts_among_the_calls_and_its_kind():
    recorder = _counting_recorder(4)
    shape = recorder.shape("barrier", "", (), 0)
    recorder.failed(shape, 0, 0.0, col.CollectiveTimeoutError("g", 0, "barrier", 0, [1], 1.0))
    recorder.failed(shape, 1, 0.0, col.PeerDiedError("g", 0, "barrier", 1, [1]))
    assert shape.calls == 2
    assert recorder.errors == {"CollectiveTimeoutError": 1, "PeerDiedError": 1}


def test_a_group_name_of_any_text_becomes_a_label_ray_takes():
    from ray_collective.metrics import label
    assert label("plain-name_1") == "plain-name_1"
    assert label("gr\u00e9-\U0001f600").isascii()
    assert label("gr\u00e9") != label("gre")

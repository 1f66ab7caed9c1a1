"""The metrics' labels stay bounded: a process labels the groups of its first
``MAX_GROUP_LABELS`` names by name and the rest as ``_other``, and every label set carries the
rank its recorder has now (a shrink renumbers it). The labels on a real endpoint are checked in
tests/test_metrics.py."""

from ray_collective import metrics
from ray_collective.recorder import FlightRecorder


def test_group_names_beyond_the_bound_share_one_label_and_earlier_ones_keep_theirs():
    flush = metrics.MetricsFlush(interval_s=60)
    names = [f"step-{i}" for i in range(metrics.MAX_GROUP_LABELS + 5)]
    labels = [flush.group_label(name) for name in names]
    assert labels[:metrics.MAX_GROUP_LABELS] == names[:metrics.MAX_GROUP_LABELS]
    assert set(labels[metrics.MAX_GROUP_LABELS:]) == {metrics.OTHER_GROUPS}
    assert flush.group_label("step-3") == "step-3"
    assert flush.group_label("caf\u00e9") == metrics.OTHER_GROUPS


def test_the_labels_carry_the_recorders_rank_as_it_is_at_the_flush():
    recorder = FlightRecorder("g", 3, "ray", 16, True)
    assert metrics._Tags(recorder, "g")("allreduce") == {
        "group": "g", "rank": "3", "backend": "ray", "collective": "allreduce"}
    recorder.rank = 1   # renumbered by a shrink
    assert metrics._Tags(recorder, "g").common() == {"group": "g", "rank": "1", "backend": "ray"}

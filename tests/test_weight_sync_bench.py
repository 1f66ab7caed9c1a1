"""benchmarks.weight_sync: the model it builds, the results page's table, and one small run of
the whole benchmark (every peer's subscribers end with the publisher's tensors)."""

import json

import numpy as np
import pytest

from benchmarks import weight_sync as bench
from support.helpers import run_python


def test_the_model_is_model_shaped():
    shapes = bench.model_shapes(256 << 20, 300)
    sizes = np.array([np.prod(s) * 4 for s in shapes.values()])
    assert len(shapes) == 300
    assert abs(sizes.sum() - (256 << 20)) < 300 * 4
    assert sizes.min() >= 1 and sizes.max() <= 128 << 20
    assert sizes.max() / np.median(sizes) > 10            # a few large tensors, many small


def result(**extra):
    return {"nodes": 1, "publishers": 1, "subscribers": 4, "model_bytes": 256 << 20,
            "dtype": "float32", "median_s": {"weight_sync": 0.5, "gloo": 1.0},
            "copy_bound_s": 0.25, **extra}


def test_the_page_table_gives_ratios_to_weight_sync_and_the_copy_bound():
    lines = bench.page_lines([{"results": [result(changed_median_s=0.05,
                                                  add_subscriber_s=0.2,
                                                  returned_after_death_s=0.07)]}])
    assert len(lines) == 3
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells[:6] == ["1", "256 MiB float32", "1 → 4", "0.500 s", "0.54", "2.00 (copy)"]
    assert cells[6:11] == ["–", "2.00×", "–", "–", "–"]
    assert cells[11:] == ["10%", "0.20 s", "0.07 s"]


def test_on_the_bed_the_bound_is_the_busiest_link():
    """1 publisher: its node sends the model once, every other node takes it in; 2 publishers
    on 2 nodes with subscribers on both: each node takes in the other's half."""
    one = result(nodes=4, subscribers=8)
    assert bench.link_bound_s(one, 1e9) == pytest.approx((256 << 20) * 8 / 1e9)
    two = result(nodes=2, publishers=2, subscribers=4)
    assert bench.link_bound_s(two, 1e9) == pytest.approx((128 << 20) * 8 / 1e9)
    row = bench.page_lines([{"results": [dict(one, link="1gbit",
                                              link_bound_s=0.25)]}])[2]
    assert row.startswith("| 4, 1gbit links |") and "| 2.00 (link) |" in row


@pytest.mark.ray
def test_a_small_run_delivers_the_model_with_every_peer(tmp_path):
    out = tmp_path / "run.json"
    finished = run_python(["-m", "benchmarks.weight_sync", "--subscribers", "2",
                           "--model-mib", "4", "--tensors", "12", "--trials", "1",
                           "--json", str(out)], 300)
    assert finished.returncode == 0, finished.stdout[-2000:] + finished.stderr[-3000:]
    [run] = json.loads(out.read_text())["results"]
    assert run["subscribers_hold_the_model"]
    assert set(run["median_s"]) == set(bench.PEERS)
    assert 0 < run["changed_median_s"]

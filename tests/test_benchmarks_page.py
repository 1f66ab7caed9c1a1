"""The results page and the plots: ratios, the brief page, both timing modes, and the
page and the README made from the results files.
"""

import json
import re

import pytest

from benchmarks.plots import write_plots
from benchmarks.report_page import (BEGIN, END, point_table, ratio, render,
                                    replace_between_markers)
from benchmarks.report_page import main as page_main


MIB = 2**20

def _rows_for_page():
    rows = []
    for world_size in (2, 4):
        for nbytes in (8, 1024):
            for backend, p50 in (("ray", 1e-4), ("gloo", 3e-4), ("mpi4py", 5e-5)):
                rows.append(dict(collective="allreduce", world_size=world_size, nbytes=nbytes,
                                 backend=backend, p50_s=p50 * world_size,
                                 busbw_gbps=nbytes / (p50 * world_size) / 1e9, error=None,
                                 note=None, processes=0, setup_rss_bytes=MIB,
                                 peak_rss_bytes=80 * MIB))
    return rows


def test_results_page_ratios_and_markers(tmp_path):
    rows = _rows_for_page()
    assert ratio(rows[0], rows[1]) == pytest.approx(3.0)
    table = point_table([row for row in rows if row["world_size"] == 2],
                        ["ray", "gloo", "mpi4py"])
    assert table[0].startswith("| size | ray p50 · busbw |")
    # Every column is the peer's p50 over ray's (MPICH's named after it): above 1, ray is faster.
    assert table[0].endswith("| ray vs gloo | ray vs MPICH |")
    assert table[2].endswith("| 3.00× | 0.50× |")
    written = write_plots(rows, tmp_path / "plots")
    assert sorted(path.name for path in written) == [
        "busbw_allreduce_2ranks.png", "busbw_allreduce_4ranks.png",
        "latency_allreduce_2ranks.png", "latency_allreduce_4ranks.png",
        "time_allreduce_1KiB.png", "time_allreduce_8B.png"]
    document = {"metadata": {"date": "2026-11-22", "cpu_count": 2, "memory_gib": 23.5,
                             "ray": "2.60.0", "numpy": "2", "command": "python -m benchmarks",
                             "options": {"backends": ["ray", "gloo", "mpi4py"]},
                             "backend_versions": {"gloo": {"torch": "2.13"}}},
                "rows": rows, "notes": []}
    source = tmp_path / "run.json"
    source.write_text(json.dumps(document))
    generated = render([([source], tmp_path / "plots")], tmp_path)
    # Rows without a timing mode come from the harness that timed every call after a barrier.
    assert "**allreduce, 4 ranks, barrier before every call**" in generated
    assert "back to back" not in generated and "(plots/time_allreduce_8B.png)" in generated
    assert "(p50 latency · bus bandwidth; ray vs X = X p50 / ray p50)" in generated
    assert "CPU" not in generated       # rows from before CPU time was measured
    assert "Timing barrier: the backend's barrier before every call" in generated
    page = f"# Results\n{BEGIN}\nold\n{END}\ntail\n"
    assert replace_between_markers(page, generated) == f"# Results\n{generated}\ntail\n"
    with pytest.raises(ValueError):
        replace_between_markers("no markers", generated)


def test_the_results_page_and_the_readme_are_made_from_the_result_files():
    from benchmarks import page
    for path, names in ((page.PAGE, list(page.PARTS)), (page.FRONT_PAGE, page.FRONT_PAGE_PARTS)):
        _, changed = page.regenerate(path, page.RESULTS, names)
        assert not changed, f"{path.name}: {changed} differ from the files: python -m benchmarks.page"
    text = page.PAGE.read_text()
    assert len(text.splitlines()) <= 300
    # Every file the page or the results' README names is there, and every file there is named.
    listed = (page.RESULTS / "README").read_text()
    for name in re.findall(r"results/([\w./-]+\.(?:json|md|png))", text):
        assert (page.RESULTS / name).is_file(), name
    for path in page.RESULTS.iterdir():
        if path.is_file() and path.name != "README":
            assert path.name in listed, f"{path.name} is not in benchmarks/results/README"


def _rows_in_both_modes():
    """The page's rows in both timing modes: back to back twice as fast as the barrier rows,
    and ray 2x faster in them only (4x its barrier time)."""
    rows = [dict(row, timing="barrier") for row in _rows_for_page()]
    return rows + [dict(row, timing="back-to-back",
                        p50_s=row["p50_s"] / (4 if row["backend"] == "ray" else 2))
                   for row in _rows_for_page()]


def _page_source(directory, rows, date):
    """A sweep's JSON file of ``rows`` (backends ray, gloo, mpi4py), written in ``directory``."""
    document = {"metadata": {"date": date, "cpu_count": 2, "memory_gib": 23.5,
                             "ray": "2.60.0", "numpy": "2", "command": "python -m benchmarks",
                             "options": {"backends": ["ray", "gloo", "mpi4py"]}},
                "rows": rows, "notes": []}
    source = directory / "both.json"
    source.write_text(json.dumps(document))
    return source


def test_the_brief_page_has_one_table_of_the_headline_mode_and_latency_plots(tmp_path):
    rows = _rows_in_both_modes()
    rows[-1] = dict(rows[-1], p50_s=None, error="rank 1: PeerDiedError")
    source = _page_source(tmp_path, rows, "2026-11-26")
    plots = tmp_path / "plots"
    write_plots(rows, plots)
    generated = render([([source], plots)], tmp_path, brief=True)
    assert generated.startswith(BEGIN) and generated.endswith(END)
    lines = generated.splitlines()
    header = lines.index("| collective | ranks | size | ray p50 | ray vs gloo | ray vs MPICH |")
    table = lines[header + 2:header + 6]
    # back to back only: ray 50 µs against gloo's 300 µs (6x), MPICH's 50 µs (1x); MPICH
    # failed at the last point.
    assert table == ["| allreduce | 2 | 8 B | 50.0 µs | 6.00× | 1.00× |",
                     "| allreduce | 2 | 1 KiB | 50.0 µs | 6.00× | 1.00× |",
                     "| allreduce | 4 | 8 B | 100.0 µs | 6.00× | 1.00× |",
                     "| allreduce | 4 | 1 KiB | 100.0 µs | 6.00× | - |"]
    assert lines[header + 6] == ""
    # Back to back is the page's timing, said once on the page, not per table.
    assert "Timing" not in generated and "barrier before" not in generated
    assert ("- Run 2026-11-26 on 2 cores / 23.5 GiB, Ray 2.60.0, numpy 2, : `python -m benchmarks`"
            in lines)
    assert "failed: 1 point(s) where a backend failed" in generated
    [images] = [line for line in lines if line.startswith("![")]   # one line, side by side
    assert re.findall(r"\]\(([^)]+)\)", images) == [
        "plots/latency_allreduce_2ranks.png", "plots/latency_allreduce_4ranks.png"]
    assert "bus bandwidth and time against ranks too: `plots/`)" in images
    assert page_main(["--brief", f"{source}={plots}"]) == 0   # the command line takes it too


def test_results_page_and_plots_show_both_timing_modes(tmp_path):
    rows = _rows_in_both_modes()
    # CPU per call in the back-to-back rows only: the busiest rank 80 %, the median 50 % of p50.
    rows = [dict(row, cpu_per_call_max_s=row["p50_s"] * 0.8,
                 cpu_per_call_median_s=row["p50_s"] * 0.5) if row["timing"] == "back-to-back"
            else row for row in rows]
    source = _page_source(tmp_path, rows, "2026-11-23")
    generated = render([([source], None)], tmp_path)
    headings = [line.split("**")[1] for line in generated.splitlines() if line.startswith("**")]
    assert headings == ["allreduce, 2 ranks, back to back",
                        "allreduce, 2 ranks, barrier before every call",
                        "allreduce, 4 ranks, back to back",
                        "allreduce, 4 ranks, barrier before every call"]
    assert ("Timing back-to-back: one barrier, then the calls in a loop; an iteration is the "
            "time from one call's return to the next's; barrier:") in generated
    tables = generated.split("**allreduce, 2 ranks, ")
    assert tables[1].splitlines()[4].startswith("| 8 B | 50.0 µs · ")   # back to back
    assert tables[1].splitlines()[4].endswith("| 6.00× | 1.00× |")
    assert tables[2].splitlines()[4].endswith("| 3.00× | 0.50× |")   # barrier
    assert "CPU/call: a rank process's CPU time (user + system)" in generated
    cpu = tables[1].split("CPU time per call per rank, back to back (the busiest rank / the "
                          "median over ranks):")[1].splitlines()
    assert cpu[2] == "| size | ray CPU/call | gloo CPU/call | mpi4py CPU/call |"
    assert cpu[4] == "| 8 B | 40.0 µs / 25.0 µs | 240.0 µs / 150.0 µs | 40.0 µs / 25.0 µs |"
    assert generated.count("CPU time per call per rank, back to back") == 2
    assert "CPU time per call per rank, barrier" not in generated   # those rows have none
    written = write_plots(rows, tmp_path / "plots")
    assert sorted(path.name for path in written) == [
        "busbw_allreduce_2ranks.png", "busbw_allreduce_4ranks.png",
        "latency_allreduce_2ranks.png", "latency_allreduce_4ranks.png",
        "time_allreduce_1KiB.png", "time_allreduce_8B.png"]



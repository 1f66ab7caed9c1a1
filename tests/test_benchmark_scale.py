"""The scale tool: the fit recovers known coefficients; the CLI writes plots and JSON; bad input
exits with status 2."""

import json
import os

import numpy as np
import pytest

from benchmarks import scale
from benchmarks.scale_costs import call_costs
from benchmarks.scale_model import PARAMETERS, features, fit_non_negative, predict

KNOWN = {"alpha_s": 200e-6, "beta_s_per_byte": 0.05e-9, "mu_s_per_message": 15e-6,
         "nu_s_per_byte": 0.25e-9}
CORES = 2
POINTS = [("recursive_doubling", p, n) for p in (2, 4, 8, 16, 64) for n in (8, 1024)] + [
    ("ring", p, n) for p in (2, 4, 8) for n in (2 ** 20, 2 ** 24)] + [
    ("reduce_broadcast", p, 8) for p in (8, 16, 64)] + [("rabenseifner", 64, 2 ** 20)]


def _regressors(algorithm, ranks, nbytes, cores=CORES):
    return features(call_costs("allreduce", algorithm, ranks, max(1, nbytes // 4)), ranks, cores)


def _synthetic_seconds(algorithm, ranks, nbytes, cores=CORES):
    return float(_regressors(algorithm, ranks, nbytes, cores) @ np.array(list(KNOWN.values())))


def test_costs_match_the_simulator_counts():
    costs = call_costs("allreduce", "recursive_doubling", 8, 256)
    assert (costs.rounds, costs.max_messages, costs.total_messages) == (3, 3, 24)
    assert costs.max_bytes == 3 * 256 * 4 and costs.total_bytes == 8 * costs.max_bytes


def test_fit_recovers_known_coefficients():
    design = np.array([_regressors(a, p, n) for a, p, n in POINTS])
    seconds = [_synthetic_seconds(a, p, n) for a, p, n in POINTS]
    fit = fit_non_negative(design, seconds, PARAMETERS)
    for name, value in KNOWN.items():
        assert fit.coefficients[name] == pytest.approx(value, rel=1e-6)
    assert fit.rms_relative_error < 1e-9
    assert predict(fit, _regressors("ring", 32, 2 ** 20, cores=32)) == pytest.approx(
        _synthetic_seconds("ring", 32, 2 ** 20, cores=32), rel=1e-6)


def test_fit_keeps_coefficients_non_negative():
    design = np.array([[1.0, 1.0], [2.0, 1.0], [3.0, 1.0]])
    fit = fit_non_negative(design, [3.0, 2.0, 1.0], ("a", "b"))
    assert min(fit.coefficients.values()) >= 0.0


def test_one_rank_per_core_is_the_classic_model():
    costs = call_costs("allreduce", "reduce_broadcast", 64, 256)
    regressors = features(costs, 64, 64)
    assert regressors[2] == costs.max_messages and regressors[3] == costs.max_bytes


def _write_measured(path, backend="ray"):
    rows = [{"collective": "allreduce", "world_size": p, "nbytes": n, "dtype": "float32",
             "backend": backend, "p50_s": _synthetic_seconds(a, p, n), "error": None}
            for a, p, n in [("recursive_doubling", 2, 8), ("recursive_doubling", 4, 8),
                            ("recursive_doubling", 8, 8), ("ring", 2, 2 ** 20),
                            ("ring", 4, 2 ** 20), ("ring", 8, 2 ** 20)]]
    rows.append({**rows[0], "backend": "gloo"})
    with open(path, "w") as handle:
        json.dump({"metadata": {"usable_cpus": CORES}, "rows": rows}, handle)


def test_cli_writes_table_plots_and_json(tmp_path, capsys):
    measured = tmp_path / "measured.json"
    _write_measured(measured)
    out = tmp_path / "scale.json"
    plots = tmp_path / "plots"
    status = scale.main(["--json-before-rule", str(measured), "--plots", str(plots),
                         "--out", str(out), "--ranks", "16,32"])
    assert status == 0
    text = capsys.readouterr().out
    assert "α per round" in text and "one rank per core" in text
    assert sorted(os.listdir(plots)) == ["scale-allreduce-1M.png", "scale-allreduce-8B.png"]
    document = json.loads(out.read_text())
    assert len(document["fit"]["points"]) == 6
    assert document["fit"]["rms_relative_error"] < 0.05
    extrapolated = [row for row in document["predictions"]
                    if row["placement"] == "one rank per core"]
    assert {(row["nbytes"], row["world_size"]) for row in extrapolated} == {
        (8, 16), (8, 32), (2 ** 20, 16), (2 ** 20, 32)}
    for row in extrapolated:
        assert all(v > 0 for v in row["seconds_by_algorithm"].values())


def test_missing_file_exits_2(tmp_path, capsys):
    assert scale.main(["--json", str(tmp_path / "absent.json")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_no_rows_of_the_backend_exits_2(tmp_path, capsys):
    measured = tmp_path / "gloo-only.json"
    _write_measured(measured, backend="gloo")
    assert scale.main(["--json", str(measured)]) == 2
    assert "no measured allreduce rows of backend 'ray'" in capsys.readouterr().err


def test_not_benchmark_json_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    assert scale.main(["--json", str(bad)]) == 2
    assert "not the JSON" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--json", "x.json", "--ranks", "1"], [],
                                  ["--json", "x.json", "--collective", "allsum"]])
def test_bad_arguments_exit_2(argv):
    with pytest.raises(SystemExit) as exit_info:
        scale.parse_options(argv)
    assert exit_info.value.code == 2


def test_unknown_forced_algorithm_exits_2(tmp_path, capsys):
    measured = tmp_path / "measured.json"
    _write_measured(measured)
    assert scale.main(["--json", f"{measured}=spiral"]) == 2
    assert "no algorithm 'spiral'" in capsys.readouterr().err


def test_algorithm_of_a_point_follows_the_selector_rule(tmp_path):
    measured = tmp_path / "measured.json"
    _write_measured(measured)
    now = scale.load_points(scale.ScaleOptions((scale.InputFile(str(measured)),)))
    before = scale.load_points(scale.ScaleOptions(
        (scale.InputFile(str(measured), oversubscription_rule=False),)))
    forced = scale.load_points(scale.ScaleOptions(
        (scale.InputFile(str(measured), "ring"),)))
    at_8_ranks = [(n.algorithm, b.algorithm) for n, b in zip(now, before)
                  if n.world_size == 8 and n.nbytes == 8]
    assert at_8_ranks == [("reduce_broadcast", "recursive_doubling")]
    assert {p.algorithm for p in forced} == {"ring"}


def test_format_size_inverts_parse_size():
    from benchmarks.cli import parse_size
    for text in ("8B", "1K", "64M", "1G"):
        assert scale.format_size(parse_size(text)) == text
    assert scale.format_size(2 ** 26) == "64M" and scale.format_size(8) == "8B"


def test_sizes_count_as_the_harness_counts_them():
    assert scale.elements_per_rank("allreduce", 1024, "float32", 8) == 256
    assert scale.elements_per_rank("allgather", 1024, "float32", 8) == 32
    assert scale.elements_per_rank("reducescatter", 8, "float32", 8) == 1
    assert scale.elements_per_rank("barrier", 0, "float32", 8) == 0

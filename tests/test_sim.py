"""The simulator at scale (64 to 4096 ranks; 4096 is marked slow) and its command line."""

import pytest

from ray_collective.sim.__main__ import main
from ray_collective.sim.runner import COLLECTIVES, simulate

SCALE = [64, 400, 1000, pytest.param(4096, marks=pytest.mark.slow)]


@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("ranks", SCALE)
def test_every_collective_at_scale_is_correct_and_within_its_formula(collective, ranks):
    count = 1 if collective in ("allgather", "gather", "scatter", "alltoall", "reducescatter") \
        else 16
    report = simulate(collective, ranks, count, root=ranks // 3)
    assert report.checked
    assert report.rounds == report.formula.rounds, report
    assert report.max_bytes_sent <= report.formula.max_elements_sent * report.itemsize, report
    assert report.seconds < 60


@pytest.mark.slow
def test_allreduce_4096_ranks_1mib_is_rabenseifner_within_formula():
    count = (1 << 20) // 4
    report = simulate("allreduce", 4096, count, dtype="float32", check=False)
    assert report.algorithm == "rabenseifner"
    assert report.rounds == 2 * 12
    # Recursive halving then doubling: 2 (p-1)/p of the buffer leaves each rank.
    assert report.max_bytes_sent == 2 * (4096 - 1) * (count // 4096) * 4
    assert report.rounds == report.formula.rounds


@pytest.mark.parametrize("ranks", [64, 400])
def test_ring_allreduce_sends_2_p_minus_1_over_p_of_the_buffer(ranks):
    count = ranks * 25
    report = simulate("allreduce", ranks, count, algorithm="ring", check=ranks <= 64)
    assert report.rounds == 2 * (ranks - 1)
    assert report.max_bytes_sent == 2 * (ranks - 1) * 25 * report.itemsize


@pytest.mark.parametrize("ranks, rounds", [(64, 6), (400, 8 + 2), (1000, 9 + 2),
                                           pytest.param(4096, 12, marks=pytest.mark.slow)])
def test_recursive_doubling_takes_log2_rounds_plus_the_fold(ranks, rounds):
    assert simulate("allreduce", ranks, 4, algorithm="recursive_doubling").rounds == rounds


def test_cli_prints_the_table(capsys):
    assert main(["--collective", "allreduce,broadcast", "--ranks", "8,9", "--bytes", "64",
                 "--algorithm", "all"]) == 0
    out = capsys.readouterr().out
    assert "recursive_doubling" in out and "rabenseifner" in out and "scatter_allgather" in out
    assert out.count("\n") >= 2 + 2 * 4


def test_cli_rejects_unknown_collective(capsys):
    with pytest.raises(SystemExit):
        main(["--collective", "allsum"])


def test_simulate_rejects_bad_arguments():
    with pytest.raises(ValueError, match="unknown collective"):
        simulate("allsum", 4, 1)
    with pytest.raises(ValueError, match="root"):
        simulate("reduce", 4, 1, root=4)
    with pytest.raises(ValueError, match="power-of-two"):
        simulate("allgather", 6, 1, algorithm="recursive_doubling")
    with pytest.raises(ValueError, match="no algorithm"):
        simulate("allgather", 6, 1, algorithm="nope")

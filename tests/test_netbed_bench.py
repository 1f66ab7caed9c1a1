"""The network bed's arithmetic, without a bed: link rates, the link bound of each collective,
the rows' ratios to it and the results page's table (``benchmarks.netbed_bench``), and the
names a bed gives what it makes (``benchmarks.netbed``)."""

import pytest

from benchmarks import netbed, netbed_bench

MIB = 1 << 20


@pytest.mark.parametrize("text, bits", [("1gbit", 1e9), ("10gbit", 1e10), ("500mbit", 5e8),
                                        ("unlimited", None), (None, None)])
def test_rates_read_in_tcs_notation(text, bits):
    assert netbed.parse_rate(text) == bits


@pytest.mark.parametrize("text", ["fast", "1gb", "gbit"])
def test_a_bad_rate_is_refused(text):
    with pytest.raises(ValueError, match="not a link rate"):
        netbed.parse_rate(text)


@pytest.mark.parametrize("collective, nodes, link_bytes", [
    ("allreduce", 2, 64 * MIB), ("allreduce", 4, 1.5 * 64 * MIB),
    ("broadcast", 4, 64 * MIB), ("allgather", 4, 0.75 * 64 * MIB),
    ("reducescatter", 2, 0.5 * 64 * MIB), ("sendrecv", 2, 2 * 64 * MIB)])
def test_the_link_bound_is_the_busiest_links_bytes_over_the_rate(collective, nodes, link_bytes):
    assert netbed_bench.link_bound_s(collective, 64 * MIB, nodes, "1gbit") == pytest.approx(
        link_bytes * 8 / 1e9)
    assert netbed_bench.link_bound_s(collective, 64 * MIB, nodes, "10gbit") == pytest.approx(
        link_bytes * 8 / 1e10)


def test_no_bound_on_an_unlimited_link_or_one_node():
    assert netbed_bench.link_bound_s("allreduce", 64 * MIB, 2, None) is None
    assert netbed_bench.link_bound_s("allreduce", 64 * MIB, 1, "1gbit") is None
    assert netbed_bench.link_bound_s("barrier", 0, 2, "1gbit") is None


def _row(backend, p50, nbytes=64 * MIB, collective="allreduce"):
    return {"collective": collective, "nbytes": nbytes, "backend": backend, "p50_s": p50,
            "timing": "back-to-back", "error": None}


def test_rows_gain_the_bound_and_the_ratios_to_it():
    bound = 64 * MIB * 8 / 1e9
    ray, failed = netbed_bench.annotate([_row("ray", 2 * bound), _row("torch", None)], 2, "1gbit")
    assert ray["link"] == "1gbit" and ray["link_bound_s"] == pytest.approx(bound)
    assert ray["ratio_to_bound"] == pytest.approx(2.0)
    assert ray["bound_fraction"] == pytest.approx(0.5)
    assert failed["ratio_to_bound"] is None and failed["bound_fraction"] is None
    unlimited, = netbed_bench.annotate([_row("ray", 0.1)], 2, None)
    assert unlimited["link"] == "unlimited" and unlimited["ratio_to_bound"] is None


def test_the_page_has_a_row_per_link_and_collective_with_bounds_for_large_sizes():
    bound = 64 * MIB * 8 / 1e9
    rows = netbed_bench.annotate([_row("ray", 1.25 * bound), _row("torch", 2.5 * bound),
                                  _row("gloo", 5 * bound), _row("ray", 1e-4, nbytes=8),
                                  _row("torch", 1e-3, nbytes=8)], 2, "1gbit")
    document = {"metadata": {"netbed": {"nodes": 2, "ranks_per_node": 2}}, "rows": rows}
    header, rule, row = netbed_bench.page_table([document])
    assert header.startswith("| ranks | link | collective | 8 B: ray p50 | vs torch / gloo | "
                             "64 MiB: ray p50 (/ bound) |")
    assert row.split(" | ") == ["| 2×2", "1gbit", "allreduce", "100 µs", "10.00× / –",
                                "671 ms (1.25×)", "2.00× / 4.00×", "–", "– |"]


def test_a_bed_names_everything_it_makes_under_its_prefix():
    layout = netbed.Layout(f"{netbed.PREFIX}abc123", 2, ("1gbit", None))
    made = [layout.switch, layout.namespace(0), layout.namespace(1), layout.directory]
    assert all(name.split("/")[-1].startswith(netbed.PREFIX) for name in made)
    assert layout.head_address == "10.213.0.1:6379" and netbed.address(1) == "10.213.0.2"


def test_the_minimal_loop_takes_a_bed_link_and_refuses_a_bad_one(capsys):
    from benchmarks import minimal_loop
    assert minimal_loop.build_parser().parse_args(["--netbed", "1gbit"]).netbed == "1gbit"
    with pytest.raises(SystemExit) as exited:
        minimal_loop.main(["--netbed", "fast"])
    assert exited.value.code == 2 and "not a link rate" in capsys.readouterr().err

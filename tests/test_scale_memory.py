"""The memory probe of ``benchmarks.scale_memory``: USS, PSS and RSS as the kernel counts them,
shared pages split between the processes that map them, and Ray's processes told apart."""

import mmap
import os
import subprocess
import sys

import pytest

from benchmarks import memory_probe, scale_memory

MIB = 2**20


def test_private_pages_count_in_uss_pss_and_rss():
    # A fresh private mapping: heap memory might reuse pages that are resident already. It is
    # large so that what the rest of the process frees or gains meanwhile (a few MiB under
    # load) cannot hide it.
    block = mmap.mmap(-1, 256 * MIB, flags=mmap.MAP_PRIVATE)
    before = memory_probe.process_memory()
    block[::4096] = b"\1" * len(block[::4096])  # every page touched
    after = memory_probe.process_memory()
    for field in ("uss", "pss", "rss"):
        assert after[field] - before[field] >= 240 * MIB, field
    assert after["uss"] <= after["pss"] <= after["rss"]
    assert after["threads"] >= 1
    block.close()


def test_a_page_shared_with_a_second_process_counts_half_in_pss_and_not_in_uss():
    region = mmap.mmap(-1, 16 * MIB, flags=mmap.MAP_SHARED)
    region[::4096] = b"\1" * len(region[::4096])
    alone = memory_probe.process_memory()
    ready_read, ready_write = os.pipe()
    done_read, done_write = os.pipe()
    child = os.fork()
    if child == 0:  # the child maps the region too (inherited), says so, waits to be told
        os.close(ready_read)
        os.write(ready_write, b"x")
        os.read(done_read, 1)
        os._exit(0)
    try:
        os.read(ready_read, 1)
        shared = memory_probe.process_memory()
    finally:
        os.write(done_write, b"x")
        os.waitpid(child, 0)
        for fd in (ready_read, ready_write, done_read, done_write):
            os.close(fd)
    # Forking shares every other page too, so only bounds hold for the whole process: the
    # region alone moves USS by its 16 MiB and PSS by half of it.
    assert alone["uss"] - shared["uss"] >= 15 * MIB
    assert 7 * MIB <= alone["pss"] - shared["pss"]
    assert alone["pss"] - shared["pss"] <= alone["uss"] - shared["uss"]
    assert shared["pss_shmem"] >= 7 * MIB
    region.close()


def test_a_process_that_is_gone_reads_as_zeros():
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True)
    gone = memory_probe.process_memory(int(finished.stdout))
    assert set(gone.values()) == {0}


def test_the_process_tree_holds_a_child_and_its_command_line():
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    try:
        assert child.pid in memory_probe.tree_pids(os.getpid())
        assert "sys.stdin.read()" in memory_probe.command_line(child.pid)
    finally:
        child.communicate(b"")
    assert child.pid not in memory_probe.tree_pids(os.getpid())


@pytest.mark.parametrize("command, kind", [
    ("/venv/lib/python3.11/site-packages/ray/core/src/ray/gcs/gcs_server --log_dir=x",
     "gcs_server"),
    ("/venv/site-packages/ray/core/src/ray/raylet/raylet --raylet_socket_name=x", "raylet"),
    ("/venv/bin/python /venv/site-packages/ray/dashboard/dashboard.py --host=127.0.0.1",
     "dashboard"),
    ("ray::DashboardAgent", "dashboard agent"),
    ("ray::RuntimeEnvAgent", "runtime env agent"),
    ("/venv/bin/python -u /venv/site-packages/ray/_private/log_monitor.py --session-dir=x",
     "log monitor"),
    ("/venv/bin/python -u /venv/site-packages/ray/autoscaler/_private/monitor.py --logs-dir=x",
     "autoscaler monitor"),
    ("ray::IDLE", "idle worker"),
    ("ray::MemoryProbe.measure", "actor"),
    ("/usr/bin/bash -c sleep 1", None),
])
def test_ray_processes_are_told_apart_by_their_command_lines(command, kind):
    assert memory_probe.process_kind(command) == kind


def test_a_stage_summary_takes_medians_and_names_the_lazy_modules_loaded():
    reports = [{"uss": u * MIB, "pss": u * MIB + MIB, "rss": 2 * u * MIB, "pss_shmem": 0,
                "threads": 23 + u % 2, "thread_names": ["MainThread"],
                "modules": ["numpy", "ray_collective", "ray_collective.backends.nccl"]}
               for u in (40, 41, 60)]
    summary = scale_memory.stage_summary("joined", reports)
    assert summary["uss_p50"] == 41 * MIB and summary["pss_p50"] == 42 * MIB
    assert summary["threads_p50"] == 23
    assert summary["ray_collective_modules"] == 2
    assert summary["lazy_loaded"] == ["ray_collective.backends.nccl"]


def test_every_setting_starts_its_own_ray_and_sets_only_ray_variables():
    """A setting never joins a Ray that another program on the machine started: it starts a
    head itself, or ``ray.init`` starts a local one."""
    for name, setting in scale_memory.SETTINGS.items():
        assert "head" in setting or setting["init"].get("address") == "local", name
        assert "address" not in setting["init"] or "head" not in setting, name
        assert all(key.startswith("RAY_") for key in setting["environment"]), name

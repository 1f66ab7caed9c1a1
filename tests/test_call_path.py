"""How deep a call of a known shape goes in Python before the native core runs it: the path of
every small call, whose frames are its cost (``docs/architecture.md``, the known-shape walk).

A profiler hook inside each rank records the Python frames between the public function and the
core's ``Node.run``; the test fails if a change adds one.
"""

import sys

import numpy as np
import pytest

import ray_collective as col
from ray_collective import native
from support.helpers import join, leave, run_in

MOST_FRAMES = 5
"""Python frames from the public function (itself included) down to the native call."""


def _frames_to_the_core(rank, group, collective):
    x = np.ones(2, np.float32)
    call = {"allreduce": lambda: col.allreduce(x, group),
            "broadcast": lambda: col.broadcast(x, 0, group)}[collective]
    for _ in range(3):  # the first call learns the shape
        call()
    seen = []

    def hook(frame, event, arg):
        if event == "c_call" and getattr(arg, "__name__", "") == "run" and \
                type(getattr(arg, "__self__", None)).__name__ == "Node":
            names, depth = [], frame
            while depth is not None and depth.f_code.co_name != collective:
                names.append(depth.f_code.co_name)
                depth = depth.f_back
            seen.append(names[::-1] if depth is not None else None)

    sys.setprofile(hook)
    try:
        call()
    finally:
        sys.setprofile(None)
    return seen


@pytest.mark.skipif(not native.available(), reason="the native core is not built here")
@pytest.mark.parametrize("collective", ["allreduce", "broadcast"])
def test_a_known_shape_call_reaches_the_core_within_a_few_frames(ray_session, members,
                                                                 collective):
    actors = members[:2]
    group = f"call-path-{collective}"
    run_in(ray_session, actors, join, group, 2)
    try:
        for seen in run_in(ray_session, actors, _frames_to_the_core, group, collective):
            assert len(seen) == 1 and seen[0] is not None, seen
            frames = [collective] + seen[0]
            assert len(frames) <= MOST_FRAMES, frames
    finally:
        run_in(ray_session, actors, leave, group)

"""An actor class written for ``ray.util.collective``, for the compatibility tests.

This module imports nothing of this project: the collective library an actor calls is named
when the actor is made (``"ray_collective"`` or ``"ray.util.collective"``), so one body of code
runs on ``ray.util.collective`` with Gloo, on ``ray.util.collective`` with ``backend="ray"``
(registered in the workers by ``ray_collective``'s setup hook, not by this module) and on
``ray_collective``. The methods do what code written for ``ray.util.collective`` does: tensors
arrive as task arguments or from ``ray.get``, and in-place collectives run on them.
"""

import importlib
import os
import sys

import ray


def _reduce_op(name):
    """``ray.util.collective``'s own ReduceOp member (``ray_collective`` accepts it by name)."""
    return importlib.import_module("ray.util.collective.types").ReduceOp[name]


class CollectiveUser:
    """One rank of a group, driven from the test's driver.

    Args:
        library: the module to call: ``"ray_collective"`` or ``"ray.util.collective"``.
    """

    def __init__(self, library):
        self.col = importlib.import_module(library)
        self.buffer = None
        self.list_buffer = None

    def loaded(self):
        """Which collective libraries this process has imported, and its pid."""
        return {"ray_collective": "ray_collective" in sys.modules,
                "ray.util.collective": "ray.util.collective" in sys.modules,
                "pid": os.getpid()}

    def init_group(self, world_size, rank, backend, group_name="default", gloo_timeout=30000):
        self.col.init_collective_group(world_size, rank, backend, group_name, gloo_timeout)
        return True

    def destroy_group(self, group_name="default"):
        self.col.destroy_collective_group(group_name)
        return True

    def is_initialized(self, group_name="default"):
        return self.col.is_group_initialized(group_name)

    def rank_and_size(self, group_name="default"):
        return self.col.get_rank(group_name), self.col.get_collective_group_size(group_name)

    def set_buffer(self, tensor):
        """Keep ``tensor`` as it arrived (a task argument); returns whether numpy may write it."""
        self.buffer = tensor
        flags = getattr(tensor, "flags", None)
        return True if flags is None else bool(flags.writeable)

    def fetch_buffer(self, refs):
        """Keep what ``ray.get`` gives for ``refs[0]``; returns whether numpy may write it."""
        self.buffer = ray.get(refs[0])
        return self.set_buffer(self.buffer)

    def set_list_buffer(self, tensors):
        self.list_buffer = list(tensors)
        return True

    def get_buffer(self):
        return self.buffer

    def allreduce(self, group_name="default", op="SUM"):
        self.col.allreduce(self.buffer, group_name, _reduce_op(op))
        return self.buffer

    def reduce(self, dst_rank=0, group_name="default", op="SUM"):
        self.col.reduce(self.buffer, dst_rank, group_name, _reduce_op(op))
        return self.buffer

    def broadcast(self, src_rank=0, group_name="default"):
        self.col.broadcast(self.buffer, src_rank, group_name)
        return self.buffer

    def allgather(self, group_name="default"):
        self.col.allgather(self.list_buffer, self.buffer, group_name)
        return self.list_buffer

    def reducescatter(self, group_name="default", op="SUM"):
        self.col.reducescatter(self.buffer, self.list_buffer, group_name, _reduce_op(op))
        return self.buffer

    def send(self, dst_rank, group_name="default"):
        self.col.send(self.buffer, dst_rank, group_name)
        return self.buffer

    def recv(self, src_rank, group_name="default"):
        self.col.recv(self.buffer, src_rank, group_name)
        return self.buffer

    def barrier(self, group_name="default"):
        self.col.barrier(group_name)
        return True

    def call(self, name, *args):
        """``self.col.<name>(*args)``, for calls made with deliberately bad arguments."""
        return getattr(self.col, name)(*args)

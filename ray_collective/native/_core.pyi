"""Types of the native core (``module.c``), for type checkers; the behaviour is documented in
``ray_collective/native/__init__.py`` and in each function's docstring."""

from typing import Any, Callable, Optional, Sequence

import numpy as np

DONE: int
PENDING: int
REROUTED: int
MISMATCH: int
HEADER_SEQ_OFFSET: int
P2P_MAX_BYTES: int
STREAM_CLOSED: int
STREAM_FOREIGN: int
STREAM_MISMATCH: int
STREAM_PROTOCOL: int
STREAM_SLICE: int
STREAM_WATCHED: int

class Program:
    """A plan code checked once, for calls of one dtype and op."""

    dtype_code: int
    op_code: int
    slots: int

    def __init__(self, code: np.ndarray, dtype_code: int, op_code: int) -> None: ...

class Node:
    """One rank's shared memory and executor on a node."""

    rank: int
    world_size: int
    ring_bytes: int
    part_bytes: int
    spin_ns: int
    remote_min_bytes: int
    p2p_max_bytes: int
    remote_reads: int
    active: bool

    def __init__(self, directory: str, rank: int, world_size: int, ring_bytes: int,
                 part_bytes: int, spin_ns: int, remote_min_bytes: int = 0) -> None: ...
    def start(self, program: Program, slots: Sequence[Any], header: bytes,
              tag: int = -1) -> None: ...
    def run(self, program: Program, slots: Sequence[Any], header: bytes, seq: int, tag: int,
            call_code: int, slice_s: float) -> int: ...
    def bind_state(self, page: Any, started_word: int, beat_word: int, call_word: int,
                   code_span: int) -> None: ...
    def progress(self, slice_s: float) -> int: ...
    def scan_incoming(self) -> int: ...
    def mismatch_details(self) -> Optional[Any]: ...
    def abandon(self) -> None: ...
    def wake_all(self) -> None: ...
    def close(self) -> None: ...
    def __enter__(self) -> "Node": ...
    def __exit__(self, *exc_info: Any) -> None: ...

def combine(dtype_code: int, op_code: int, acc: Any, incoming: Any) -> None: ...
def digest(buffer: Any) -> int: ...
def itemsize(dtype_code: int) -> int: ...
def stream_round(fds: Sequence[int], table: Any, slots: Sequence[Any], header: bytes,
                 dtype_code: int, op_code: int, tag: int, part_bytes: int,
                 max_frame_bytes: int, timeout_s: float, slice_s: float,
                 on_event: Optional[Callable[..., Any]], watched: Any,
                 spin_s: float) -> Sequence[int]: ...

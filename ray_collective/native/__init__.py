"""The native core of the data path: a C extension that runs a whole recorded plan over shared
memory on a node, and rounds of messages over the TCP streams between nodes, with the GIL
released.

Importing this package never fails: :func:`available` says whether the extension was built and
imports, :func:`import_error` why not. The extension, ``ray_collective.native._core``::

    program = Program(code, dtype_code, op_code)   # a plan code checked once, kept
    node = Node(directory, rank, world_size, ring_bytes, part_bytes, spin_ns,
                remote_min_bytes=0)
    node.start(program, slots, header, tag=-1)
    status = node.progress(slice_s)        # DONE, REROUTED, PENDING or MISMATCH
    status = node.run(program, slots, header, seq, tag, call_code, slice_s)
    node.bind_state(page, started_word, beat_word, call_word, code_span)
    node.mismatch_details()                # after MISMATCH: a dict, else None
    node.abandon()                         # forget a failed or unfinished call
    node.wake_all()                        # every rank of the node returns PENDING once, now
    node.close()                           # also a context manager
    combine(dtype_code, op_code, acc, incoming)   # the reduction kernel alone
    itemsize(dtype_code)                          # bytes per element (0: unknown code)
    digest(buffer)                                # weight sync's change digest (digest.c)
    pending = stream_round(fds, table, slots, header, dtype_code, op_code, tag, part_bytes,
                           max_frame_bytes, timeout_s, slice_s, on_event, watched, spin_s)

- ``Program(code, dtype_code, op_code)``: ``code`` is :func:`codes.encode_plan`'s int64
  array, which the program copies and checks once (TypeError for another dtype; ValueError
  for a malformed code, a reduction without a kernel for the dtype and op codes from
  :mod:`.codes`, ``NO_OP`` where nothing is reduced), noting what its calls need: the
  elements each slot must have (``slots``: how many it names), the slots it writes, the ranks
  it talks to. Read-only attributes ``dtype_code``, ``op_code``, ``slots``. Every call of the
  shape passes the program and its arrays; nothing of the code is copied or checked again.
- ``Node(...)``: ``directory`` is a private directory (this user's, mode 0700, else
  PermissionError) shared by the ranks of one group on one node, which all pass the same
  ``world_size``, ``ring_bytes`` (data bytes per ring: a multiple of 128, at least 1024) and
  ``part_bytes`` (the largest part a message is cut into, at least 16); ``spin_ns`` is how
  long a waiting rank polls, yielding its core between polls, before it sleeps (0: sleep at
  once). It creates or opens ``doorbell`` there (64 bytes per rank, plus 64) and, at the first
  call that names a peer, ``ring-<src>-<dst>`` (128 + ring_bytes, of which tmpfs backs only the
  pages touched). A file that is a symlink is refused with OSError (ELOOP), one of another
  user or open to group or others with PermissionError, one of another size with OSError
  (EINVAL); ValueError for bad parameters. ``remote_min_bytes`` (0: never): in a collective
  that reduces nothing (op code ``NO_OP``, a negative tag), a message this large is offered to
  its receiver, which reads it from the sender's memory itself (``process_vm_readv``, one copy
  instead of two; ``remote.c`` says how the two sides agree, and falls back to the ring where
  the kernel refuses). A point-to-point message (a tag >= 0) larger than ``p2p_max_bytes``
  (64 KiB, or a quarter of a ring if less) is only ever offered so, whatever
  ``remote_min_bytes``: a send takes its offer back if its receiver has not begun to read it
  within 1 ms, or at once if that receiver waits on an offer of its own (one to this rank,
  which it then declines, or one to another rank, which the receiver's doorbell shows), and a
  message not read in place ends the call with ``REROUTED`` on both sides
  (with ``remote_min_bytes`` 0 at once: the offer then only carries the call's header ahead).
  Read-only attributes: ``rank``, ``world_size``, ``ring_bytes``, ``part_bytes``,
  ``spin_ns``, ``remote_min_bytes``, ``p2p_max_bytes``, ``remote_reads`` (messages this rank
  has read in place), ``active`` (a call is running).
- ``start``: ``program`` the call shape's ``Program``; ``slots`` the call's arrays,
  ``plan.slots(buf, recvbuf)`` (C-contiguous, aligned, of the dtype code's item size;
  writable, except a slot the plan only sends from: a reduce's input on a rank that gets no
  result may be read-only, and a plan that would write into a read-only slot is refused); ``header`` the call's packed header (``CallStamp.packed``), carried and checked on
  every message; ``tag`` the channel (-1, ``wire.COLLECTIVE_TAG``, for collectives: any
  negative tag is a channel whose call numbers all ranks share; a point-to-point tag >= 0
  otherwise). The node holds the slots' buffers until the call ends (DONE,
  MISMATCH) or is abandoned. Raises TypeError (not a Program), ValueError (a slot smaller
  than the program reaches, or read-only where it writes; a peer outside the world or this
  rank; a ring too small for the header), OSError (a ring file), RuntimeError (a call is
  running already).
- ``progress(slice_s)`` runs the call, GIL released, for at most about ``slice_s`` seconds:
  ``DONE`` (the results are in the slots; every byte this rank sent is in a ring or was
  read), ``REROUTED`` (done, but its large point-to-point message was not read in place: the
  caller moves it over its transport), ``PENDING``
  (call again: it resumes where it stopped; also returned at once, once per ``wake_all`` by
  any rank of the node that this node has not seen yet), ``MISMATCH`` (a message differs from what
  this rank expects; the call is over). MemoryError if overflow memory runs out.
- ``run(...)``: ``start`` and a first ``progress(slice_s)`` in one call, the cheap way to run a
  small call (every argument by position or by name; a call of at most 64 KiB of slots runs
  its first passes, until it must wait, with the GIL held): ``header`` is a packed header whose call number (at ``HEADER_SEQ_OFFSET``) is
  replaced by ``seq``. Once ``bind_state`` named this rank's words of its group's state page
  (``transport.node_state``: int64 words of a writable buffer the node holds until it
  closes), ``run`` of a collective (a negative tag) records there what ``NodeState.arrive``
  would (the started call number, a beat of now in milliseconds of ``CLOCK_MONOTONIC``, and
  now times ``code_span`` plus ``call_code``), and on ``DONE`` what ``NodeState.complete``
  would (a beat of 0); a point-to-point call (its numbers count per peer and tag) leaves
  them alone, as the transport's own path does.
- ``mismatch_details()``: ``peer``; ``reason`` (``"header"``, ``"step"``, ``"count"``,
  ``"part"`` or ``"a malformed frame"``); what the message said: ``header`` (its packed call
  header, for ``wire.mismatch``), ``step``, ``count``, ``nbytes``, ``part_offset``,
  ``part_bytes``, ``tag``; and ``expected_step``, ``expected_count`` of the receive (-1 when
  the message was found at the head of a ring before any receive from that peer: same call
  number, other header).
- ``stream_round(...)`` runs one round of messages over connected, authenticated stream
  sockets ``fds`` (``streams.c``; ``engine.stream_rounds`` is its caller): ``table`` an int64
  array of
  rows ``stream, flags, step, slot, start, stop`` (the stream an index into ``fds``, flags and
  elements as in the plan code), ``slots`` and ``header`` as for ``start``; sends are framed
  as ``transport.tcp`` frames them, in parts of ``part_bytes``, and frames longer than
  ``max_frame_bytes`` are refused. It returns the indices of the messages still pending after
  ``timeout_s`` (empty once all are done). A round with nothing to move polls for ``spin_s``
  (below 1), yielding its core between polls, before it sleeps in ``ppoll``, and again only
  once a stream has moved (0: sleep at once). ``on_event(kind, stream, detail)`` is called with the
  GIL: ``STREAM_SLICE`` every ``slice_s`` of waiting (it may raise, which ends the round);
  ``STREAM_FOREIGN`` with a whole frame (bytes, its length prefix stripped) that is not of the
  round's tag; ``STREAM_WATCHED`` when socket ``watched[stream]`` (sockets the round polls
  while it waits but never reads: the caller's listener, its other streams) is ready, for the
  caller to serve (the round polls it no more); and, where it must raise (else RuntimeError), ``STREAM_CLOSED`` (the stream ended
  or failed), ``STREAM_PROTOCOL`` (a frame the protocol forbids; detail says how) and
  ``STREAM_MISMATCH`` (detail: the message's index, its bytes received, then the part's header,
  step, count, message bytes, offset and size). ValueError for a malformed table, MemoryError.
- Constants ``DONE``, ``REROUTED``, ``PENDING``, ``MISMATCH``, and ``HEADER_SEQ_OFFSET`` (where the packed
  header holds the call number; ``wire.CallHeader.SEQ_OFFSET``); ``STREAM_*`` as above.

Semantics kept from ``executor.run_plan``: messages between two ranks on one tag are matched in
posting order; each part's header, step, element count, message size and offset are checked
against the receive. Sends are eager: a send completes once its bytes are in the ring or copied
aside (see ``executor.c``), so any plan runs whatever ``ring_bytes``; an offered message
completes once its receiver has read it, or, after a stall of 20 ms, is taken back and sent
through the ring like the others. One difference from the
Python transport: a call ends only when every byte it sent is in a ring or read, so a send
whose receiver never posts a receive from this rank and never drains its ring (small
point-to-point messages that fill the ring before the peer receives them) waits for it, as
MPI's sends do.

Layout of the native code: ``kernels.c`` (reductions), ``shm.c`` (files, rings, doorbells),
``program.c`` (the plan code, checked once), ``node.c`` (a rank's node, a call's start and end),
``executor.c`` (a call's messages and local steps), ``remote.c`` (large messages read in
place), ``progress.c`` (waiting), ``streams.c`` (rounds over the streams between nodes),
``module.c``, ``module_node.c``, ``module_program.c`` and ``module_streams.c`` (this API: the
module, the ``Node`` and ``Program`` types, ``stream_round``).
"""

from __future__ import annotations

import importlib
from typing import Optional

try:
    _core = importlib.import_module(f"{__name__}._core")
except ImportError as err:  # not built: the pure-Python engine stays the only one
    _core = None
    _IMPORT_ERROR: Optional[str] = (
        f"{type(err).__name__}: {err} (the extension is built by 'pip install' where a C "
        f"compiler and the Python headers are present; reinstall once they are)")
else:
    _IMPORT_ERROR = None


def available() -> bool:
    """Whether the native core was built and imports."""
    return _core is not None


def import_error() -> Optional[str]:
    """Why the native core did not import, or None when it did."""
    return _IMPORT_ERROR


def core():
    """The extension module itself.

    Raises:
        ImportError: the core did not import (:func:`import_error` says why).
    """
    if _core is None:
        raise ImportError(f"ray_collective's native core is not available: {_IMPORT_ERROR}")
    return _core

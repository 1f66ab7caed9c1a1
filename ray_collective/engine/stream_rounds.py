"""Rounds between nodes on the native core: a call's messages over the TCP streams, in C.

In a group on the native core that spans nodes, the rounds between this node's ranks run in
the core over shared memory (``NativeRunner``); a round whose peers are all on other nodes (of
any plan the executor runs over the transport: the hierarchical algorithms' runs between nodes,
other collectives' rounds, a send or recv) once ran on the Python engine, a few dozen Python
calls per frame. :class:`StreamRounds` runs it in the core's ``stream_round`` (``streams.c``):
it frames and writes the sends, reads, checks and copies or reduces the receives, with the GIL
released, on the very streams the stream carrier opened and authenticated
(``transport.stream_carrier``), frames byte for byte those of ``transport.tcp``.

A round goes to the core only where every stream it uses is *quiet*
(``StreamCarrier.quiet_streams``): open, nothing queued to send, nothing read ahead, no part
of the call's channel from that peer waiting in the inbox, and the stream a peer sends on
known (from the join, which opened the pair's one stream, or else from the peer's first
message, which came over the Python engine). Then every byte of the round's
messages is still ahead in the kernel, in order, and the core reads no further than the
round's last frame; otherwise the round runs on the Python engine as before. Both ends decide
alone: the frames are the same either way.

What the core meets that is not the round's (another channel's frame, an ABORT) it hands back
whole, and the carrier handles it as if it had read it (``StreamCarrier.deliver``). While the
round waits, the core polls the rank's other sockets too and hands back any that is ready for
the progress loop to serve (``ProgressLoop.serve``): a connection to accept and authenticate,
another stream's frames. Between slices of ``slice_s`` the rank looks for failures as the
progress loop's wait does; a stream that ends, a frame the protocol forbids and a part unlike
what the receive expects raise what the Python engine raises; a lost post office is looked
for at every round, as at every wait.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import ModuleType
from typing import Callable, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from ..errors import CollectiveMismatchError
from ..native import codes
from ..transport import tcp, wire
from ..transport.base import SendRequest, Transport
from ..transport.failures import REMOTE_LIVENESS_INTERVAL_S
from ..transport.stream_carrier import StreamCarrier
from .plan import Local, Plan


class StreamRound(NamedTuple):
    """One round of a plan, in the form ``stream_round`` takes.

    Attributes:
        peers: the round's peers; peer ``i``'s messages go on stream ``2 i`` (sends) and
            ``2 i + 1`` (receives).
        table: one row per message: stream index, flags, step, slot, start, stop.
        requests: one per peer (what a failure check asks about).
        ways: per peer, whether the round sends to it and whether it receives from it.
    """

    peers: Tuple[int, ...]
    table: np.ndarray
    requests: Tuple[SendRequest, ...]
    ways: Tuple[Tuple[bool, bool], ...]


class StreamPlan(NamedTuple):
    """A plan's rounds between nodes, prepared for the core.

    Attributes:
        rounds: per step of the plan, its :class:`StreamRound` (None for a local step, or a
            round with a peer on this node).
        dtype_code: the wire dtype's code.
        op_code: the reduction's code (``codes.NO_OP`` where nothing is reduced).
    """

    rounds: Tuple[Optional[StreamRound], ...]
    dtype_code: int
    op_code: int


def prepare(plan: Plan, dtype_code: int, op_code: int,
            elsewhere: Callable[[int], bool]) -> Optional[StreamPlan]:
    """The core's form of ``plan``'s rounds whose peers are all on other nodes
    (``elsewhere(peer)``); None when it has none."""
    rounds = []
    for step in plan.steps:
        if type(step) is Local or not all(elsewhere(message.peer) for message in step):
            rounds.append(None)
            continue
        peers: list = []
        rows = []
        sends_to, receives_from = set(), set()
        for is_send, peer, number, (slot, start, stop), reduce in step:
            if peer not in peers:
                peers.append(peer)
            (sends_to if is_send else receives_from).add(peer)
            flags = (codes.MESSAGE_SEND if is_send else 0) | (
                codes.MESSAGE_REDUCE if reduce else 0)
            # Two streams per peer, the one this rank sends on and the one the peer sends on
            # (the same socket, unless both ends connected at once: StreamCarrier).
            rows.append([2 * peers.index(peer) + (0 if is_send else 1), flags, number, slot,
                         start, stop])
        table = np.array(rows, np.int64).reshape(-1, 6)
        table.flags.writeable = False
        ways = tuple((peer in sends_to, peer in receives_from) for peer in peers)
        rounds.append(StreamRound(tuple(peers), table,
                                  tuple(SendRequest(peer) for peer in peers), ways))
    if not any(rounds):
        return None
    return StreamPlan(tuple(rounds), dtype_code, op_code)


@dataclass(eq=False)
class StreamRounds:
    """Runs one rank's rounds between nodes in the core, where their streams are quiet.

    Args:
        core: the ``_core`` module.
        carrier: the rank's stream carrier.
        transport: the rank's transport (failure checks).
        slice_s: the longest the core waits before the rank looks for failures.
        spin_s: how long a round with nothing to move polls, yielding its core between
            polls, before it sleeps (``engine.native_runner.CORE_SPIN_S``, as the rings' waits).
    """

    core: ModuleType
    carrier: StreamCarrier
    transport: Transport
    slice_s: float
    spin_s: float
    rounds_run: int = field(default=0, init=False)
    """Rounds the core took on, finished or failed (tests and benchmarks ask)."""

    def run(self, plan: StreamPlan, index: int, slots: Sequence[np.ndarray],
            stamp: wire.CallStamp, deadline: float, tag: int,
            watch: Optional[Callable[[], None]] = None) -> Optional[Sequence[int]]:
        """Run round ``index`` of ``plan`` in the core, if its streams are quiet.

        Args:
            plan: the prepared plan.
            index: the round's step in the plan.
            slots: the call's arrays.
            stamp: the call's header.
            deadline: when the call must be over (``time.monotonic()``).
            tag: the call's channel.
            watch: called between slices too (``executor.run_plan``'s watch).

        Returns:
            None when the round cannot run in the core (the caller runs it on the transport);
            else the peers still pending at the deadline (empty: the round is done).

        Raises:
            CollectiveMismatchError, PeerDiedError, GroupBrokenError, CollectiveError: as the
                Python engine would for the same frames and failures.
        """
        round_ = plan.rounds[index]
        if round_ is None:
            return None
        carrier = self.carrier
        streams = []
        for peer, (sends, receives) in zip(round_.peers, round_.ways):
            pair = carrier.quiet_streams(peer, tag, sends, receives)
            if pair is None:
                return None
            streams += pair
        transport, progress = self.transport, carrier.progress
        transport.name_call(stamp)
        progress.raise_if_post_office_lost()
        peers = set(round_.peers)
        next_remote = [time.monotonic() + REMOTE_LIVENESS_INTERVAL_S]

        def on_event(kind: int, which: int, detail) -> None:
            # As the progress loop's wait does between its polls (transport.progress).
            core = self.core
            if kind == core.STREAM_SLICE:
                if watch is not None:
                    watch()
                progress.raise_if_post_office_lost()
                now = time.monotonic()
                if progress.look_for_failures(peers, now, now >= next_remote[0]):
                    next_remote[0] = now + REMOTE_LIVENESS_INTERVAL_S
                progress.raise_if_failed(round_.requests)
                return
            if kind == core.STREAM_WATCHED:
                progress.serve(watched[which])
                progress.raise_if_failed(round_.requests)
                return
            stream, peer = streams[which], round_.peers[which // 2]
            if kind == core.STREAM_FOREIGN:
                carrier.deliver(stream, detail)
                progress.raise_if_failed(round_.requests)
                return
            if kind == core.STREAM_MISMATCH:
                raise _mismatch(transport.rank, peer, stamp, round_, slots, detail)
            if kind == core.STREAM_PROTOCOL:
                carrier.refuse(stream, ValueError(detail))
            else:
                carrier.ended(stream)
            progress.raise_if_failed(round_.requests)
            raise carrier.failures.peer_died([peer])  # not reached: the check raises

        self.rounds_run += 1
        fds = [stream.fd for stream in streams]
        # The rank's other sockets are served while the round waits, as in the progress loop's wait:
        # a listener accepts and authenticates, other streams deliver.
        watched = [fd for fd in progress.sockets() if fd not in fds]
        pending = self.core.stream_round(
            fds, round_.table, slots, stamp.packed, plan.dtype_code, plan.op_code, tag,
            tcp.STREAM_PART_BYTES, tcp.MAX_FRAME_BYTES, max(0.0, deadline - time.monotonic()),
            self.slice_s, on_event, watched, self.spin_s)
        return [round_.peers[round_.table[i, 0] // 2] for i in pending]


def _mismatch(rank: int, peer: int, stamp: wire.CallStamp, round_: StreamRound,
              slots: Sequence[np.ndarray], detail) -> Exception:
    """The error the inbox raises for the part ``detail`` describes (``stream_round``'s
    mismatch: the message's index and bytes received so far, then the part's header, step,
    count, message bytes, offset and size)."""
    index, received, header, step, count, nbytes, part_offset, part_bytes = detail
    _, _, expected_step, slot, start, stop = (int(word) for word in round_.table[index])
    out = slots[slot][start:stop]
    difference = wire.part_difference(rank, peer, stamp, expected_step, out, received,
                                      header, step, count, nbytes, part_offset, part_bytes)
    if difference is None:  # the core and the inbox check alike; kept should they not
        mine = stamp.header
        difference = CollectiveMismatchError(mine.group, rank, peer, mine.collective, mine.seq,
                                             {"message": ("as expected", "refused by the core")})
    return difference

"""Joining an NCCL clique: GPU counts checked, rank 0's unique id handed out, communicators made.

A clique is a set of NCCL communicators that share one unique id: the group's main clique has
one communicator per GPU of every process (``world_size * gpus_per_process`` of them); a
process with several GPUs also gets, on first use, one single-GPU clique per GPU index for the
plain (not ``*_multigpu``) collectives. Joining one takes three steps through the group's
:class:`~ray_collective.backends.nccl.rendezvous.Rendezvous`, under ``<group>/<clique>/``:

1. Every rank but 0 publishes ``rank/<r>``: its GPU count, its devices and a fresh nonce.
2. Rank 0 reads them (deleting each), and if every rank owns as many GPUs as it does, draws the
   unique id and publishes ``reply``: the id plus the nonce of every rank it answers; otherwise
   the reply carries the error, and every rank raises it.
3. Each rank reads ``reply``, accepting it only if it carries its own nonce (a reply left by an
   earlier attempt that failed is ignored), and creates its communicators.

``ncclCommInitRank`` blocks until the whole clique has joined, so rank 0 deletes ``reply`` once
its own communicators exist: by then every rank has read it. Creation runs on a helper thread so
that the deadline holds even when a rank never comes (a communicator cannot be aborted before it
exists); a creation that completes after its deadline aborts what it made.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from typing import Any, Dict, List, Sequence, Tuple

from ...errors import CollectiveError, CollectiveTimeoutError
from .library import NcclLibrary
from .rendezvous import Look, Rendezvous

_STALE_REPLY_POLL_S = 0.005


def _encode(record: dict) -> bytes:
    return json.dumps(record, sort_keys=True).encode()


def _decode(raw: bytes, group_name: str, rank: int, key: str) -> dict:
    try:
        record = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError):
        record = None
    if not isinstance(record, dict):
        raise CollectiveError(
            f"rank {rank} of group '{group_name}': the rendezvous record '{key}' is not one this "
            f"library wrote. Is another program using the same group name? Pick another "
            f"group_name.")
    return record


class CliqueJoin:
    """One rank's part in forming one clique.

    Args:
        rendezvous: where the ranks meet.
        library: the NCCL library (draws the id, creates the communicators).
        group_name: the group.
        clique: the clique's name within the group (``"world"``, ``"gpu1"``).
        world_size: number of processes in the group.
        rank: this process's rank.
        devices: the GPUs this process brings, one communicator each.
        what: how errors name the step (``"init"``, or the collective that needed the clique).
        seq: the sequence number errors show.
        timeout: the deadline, in seconds, for the whole join.
        look: called while waiting for the other ranks (see ``Rendezvous.fetch``).
    """

    def __init__(self, rendezvous: Rendezvous, library: NcclLibrary, group_name: str,
                 clique: str, world_size: int, rank: int, devices: Sequence[int], what: str,
                 seq: int, timeout: float, look: Look = None):
        self.rendezvous = rendezvous
        self.look = look
        self.library = library
        self.group_name = group_name
        self.world_size = world_size
        self.rank = rank
        self.devices = tuple(devices)
        self.what = what
        self.seq = seq
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self._prefix = f"{group_name}/{clique}/"

    def run(self) -> List[Any]:
        """Join: agree on the unique id, then create this process's communicators.

        Returns:
            One communicator per device, in the order of ``devices``; communicator i has NCCL
            rank ``rank * len(devices) + i`` among ``world_size * len(devices)``.

        Raises:
            CollectiveTimeoutError: a rank did not arrive before the deadline.
            ValueError: the processes do not all own the same number of GPUs.
            CollectiveError: NCCL failed to create the communicators.
        """
        gpus = len(self.devices)
        if self.world_size == 1:
            unique_id = self.library.unique_id()
        elif self.rank == 0:
            unique_id = self._hand_out_id(gpus)
        else:
            unique_id = self._receive_id(gpus)
        members = [(device, self.rank * gpus + i) for i, device in enumerate(self.devices)]
        try:
            return self._create(unique_id, self.world_size * gpus, members)
        finally:
            if self.rank == 0:
                self.rendezvous.delete(self._prefix + "reply")

    def _remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def _timed_out(self, missing: Sequence[int]) -> CollectiveTimeoutError:
        return CollectiveTimeoutError(self.group_name, self.rank, self.what, self.seq, missing,
                                      self.timeout)

    def _hand_out_id(self, gpus: int) -> bytes:
        records: Dict[int, dict] = {}
        for peer in range(1, self.world_size):
            key = f"{self._prefix}rank/{peer}"
            raw = self.rendezvous.fetch(key, self._remaining(), self.look)
            if raw is None:
                missing = [r for r in range(1, self.world_size) if r not in records]
                raise self._timed_out(missing)
            self.rendezvous.delete(key)
            records[peer] = _decode(raw, self.group_name, self.rank, key)
        nonces = {str(peer): record.get("nonce") for peer, record in records.items()}
        others = {peer: record.get("gpus") for peer, record in records.items()
                  if record.get("gpus") != gpus}
        if others:
            error = self._count_mismatch(gpus, others)
            self.rendezvous.publish(self._prefix + "reply",
                                    _encode({"error": error, "nonces": nonces}))
            raise ValueError(error)
        unique_id = self.library.unique_id()
        self.rendezvous.publish(self._prefix + "reply",
                                _encode({"unique_id": unique_id.hex(), "nonces": nonces}))
        return unique_id

    def _count_mismatch(self, gpus: int, others: Dict[int, Any]) -> str:
        listed = ", ".join(f"rank {peer} has {count}" for peer, count in sorted(others.items()))
        return (f"group '{self.group_name}': every process of an nccl group must own the same "
                f"number of GPUs, but rank 0 has {gpus} "
                f"({', '.join(f'cuda:{d}' for d in self.devices)}) and {listed}. Give every "
                f"actor the same num_gpus, or the same number of devices in "
                f"NcclBackendFactory(devices=...).")

    def _receive_id(self, gpus: int) -> bytes:
        nonce = secrets.token_hex(8)
        mine = self._prefix + f"rank/{self.rank}"
        self.rendezvous.publish(mine, _encode({"gpus": gpus, "devices": list(self.devices),
                                               "nonce": nonce}))
        try:
            record = self._fresh_reply(nonce)
        except BaseException:
            self.rendezvous.delete(mine)
            raise
        if "error" in record:
            raise ValueError(str(record["error"]))
        try:
            return bytes.fromhex(record["unique_id"])
        except (KeyError, TypeError, ValueError):
            raise CollectiveError(
                f"rank {self.rank} of group '{self.group_name}': rank 0's reply carries no "
                f"valid NCCL unique id. Is another program using the same group name? Pick "
                f"another group_name.") from None

    def _fresh_reply(self, nonce: str) -> dict:
        key = self._prefix + "reply"
        while True:
            raw = self.rendezvous.fetch(key, self._remaining(), self.look)
            if raw is None:
                raise self._timed_out([0])
            record = _decode(raw, self.group_name, self.rank, key)
            nonces = record.get("nonces")
            if isinstance(nonces, dict) and nonces.get(str(self.rank)) == nonce:
                return record
            # A reply to an earlier attempt: wait for rank 0 to answer this one.
            if self._remaining() <= 0:
                raise self._timed_out([0])
            time.sleep(min(_STALE_REPLY_POLL_S, self._remaining()))

    def _create(self, unique_id: bytes, nranks: int,
                members: Sequence[Tuple[int, int]]) -> List[Any]:
        outcome: Dict[str, Any] = {}
        lock = threading.Lock()
        finished = threading.Event()

        def create() -> None:
            try:
                communicators = self.library.open_communicators(unique_id, nranks, members)
            except BaseException as err:  # handed to the waiting thread below
                outcome["error"] = err
                finished.set()
                return
            with lock:
                abandoned = outcome.get("abandoned", False)
                outcome["communicators"] = communicators
            if abandoned:
                for communicator in communicators:
                    self.library.abort(communicator)
            finished.set()

        helper = threading.Thread(target=create, daemon=True,
                                  name=f"ray_collective[{self.group_name}] nccl init")
        helper.start()
        if not finished.wait(self._remaining()):
            with lock:
                outcome["abandoned"] = True
                made = outcome.get("communicators")
            if made is None:
                raise self._timed_out([r for r in range(self.world_size) if r != self.rank])
        if "error" in outcome:
            err = outcome["error"]
            raise CollectiveError(
                f"rank {self.rank} of group '{self.group_name}': {self.what} #{self.seq}: NCCL "
                f"could not create the communicators on {self._device_names()} "
                f"({type(err).__name__}: {err}). Check that every rank joins with the same "
                f"world_size and that the GPUs are healthy, then create the group again.") \
                from err
        return outcome["communicators"]

    def _device_names(self) -> str:
        return ", ".join(f"cuda:{d}" for d in self.devices)

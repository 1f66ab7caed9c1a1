"""The handshake that opens a stream between nodes: both ends prove they know the group's key.

The group's incarnation key is never sent. A challenge-response with HMAC-SHA256:

1. the accepting end sends ``CHALLENGE`` (a magic and its 16-byte random nonce);
2. the connecting end answers ``RESPONSE``: its rank, its own nonce and
   ``HMAC(key, "connect" | both nonces | both ranks)``;
3. the accepting end checks it (``hmac.compare_digest``) and sends ``PROOF``:
   ``HMAC(key, "accept" | both nonces | both ranks)``; the connecting end checks it before it
   sends anything of the group's.

Sans-I/O: :class:`Handshake` says how many bytes its next message has and what to answer to
it; the stream (``transport.tcp``) reads exactly that many bytes, never one more, so that
nothing a connection that fails sent afterwards is ever read.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from typing import Optional

NONCE_BYTES = 16
MAC_BYTES = hashlib.sha256().digest_size
MAGIC = b"RCS1"
CHALLENGE = struct.Struct(f"<4s{NONCE_BYTES}s")
RESPONSE = struct.Struct(f"<i{NONCE_BYTES}s{MAC_BYTES}s")
PROOF = struct.Struct(f"<{MAC_BYTES}s")
_RANKS = struct.Struct("<ii")


class HandshakeError(ConnectionError):
    """The other end of a stream did not prove knowledge of the group's key."""


def handshake_mac(key: bytes, role: bytes, accept_nonce: bytes, connect_nonce: bytes,
                  connecting_rank: int, accepting_rank: int) -> bytes:
    """The HMAC one end of a handshake presents.

    Args:
        key: the group's incarnation key.
        role: ``b"connect"`` or ``b"accept"`` (so that one end's answer never serves the other).
        accept_nonce: the accepting end's nonce.
        connect_nonce: the connecting end's nonce.
        connecting_rank: the rank that connected.
        accepting_rank: the rank that accepted.

    Returns:
        32 bytes of HMAC-SHA256.
    """
    message = (b"ray_collective stream " + role + accept_nonce + connect_nonce
               + _RANKS.pack(connecting_rank, accepting_rank))
    return hmac.new(key, message, hashlib.sha256).digest()


class Handshake:
    """One end's side of the handshake.

    Args:
        rank: this end's rank.
        key: the group's incarnation key.
        peer: the rank this end connects to; None for an accepting end (the peer's rank is
            known once its response proves the key).

    Attributes:
        peer: the rank at the other end (-1 until an accepting end has checked the response).
        done: the other end has proved the key.
    """

    def __init__(self, rank: int, key: bytes, peer: Optional[int] = None):
        self.rank = rank
        self.peer = -1 if peer is None else peer
        self.done = False
        self._key = key
        self._connecting = peer is not None
        self._accept_nonce = b""
        self._connect_nonce = b""

    def opening(self) -> Optional[bytes]:
        """What this end sends first, before reading anything: the accepting end's challenge
        (None for a connecting end, which waits for it)."""
        if self._connecting:
            return None
        self._accept_nonce = os.urandom(NONCE_BYTES)
        return CHALLENGE.pack(MAGIC, self._accept_nonce)

    def expected_bytes(self) -> int:
        """The size of the message this end reads next."""
        if not self._connecting:
            return RESPONSE.size
        return PROOF.size if self._accept_nonce else CHALLENGE.size

    def receive(self, message: bytes) -> Optional[bytes]:
        """Take the other end's next message (exactly :meth:`expected_bytes` long).

        Returns:
            What to send back, or None.

        Raises:
            HandshakeError: the message does not prove the key (the caller closes the stream).
        """
        if not self._connecting:
            peer, self._connect_nonce, mac = RESPONSE.unpack(message)
            expected = handshake_mac(self._key, b"connect", self._accept_nonce,
                                     self._connect_nonce, peer, self.rank)
            if not hmac.compare_digest(mac, expected) or peer < 0:
                raise self._refused()
            self.peer, self.done = peer, True
            return PROOF.pack(handshake_mac(self._key, b"accept", self._accept_nonce,
                                            self._connect_nonce, peer, self.rank))
        if not self._accept_nonce:
            magic, self._accept_nonce = CHALLENGE.unpack(message)
            if magic != MAGIC:
                raise self._refused()
            self._connect_nonce = os.urandom(NONCE_BYTES)
            return RESPONSE.pack(self.rank, self._connect_nonce, handshake_mac(
                self._key, b"connect", self._accept_nonce, self._connect_nonce, self.rank,
                self.peer))
        expected = handshake_mac(self._key, b"accept", self._accept_nonce, self._connect_nonce,
                                 self.rank, self.peer)
        if not hmac.compare_digest(PROOF.unpack(message)[0], expected):
            raise self._refused()
        self.done = True
        return None

    def _refused(self) -> HandshakeError:
        return HandshakeError(f"rank {self.rank}: a stream's other end did not prove the "
                              f"group's key; it was closed")


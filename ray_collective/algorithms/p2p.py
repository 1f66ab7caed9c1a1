"""Point-to-point send and recv: one message, straight to the peer, in one round.

Messages between two ranks on one tag are matched in order, so a sequence of sends meets the
same sequence of recvs; each tag is its own ordered channel.
"""

from __future__ import annotations

import numpy as np

from .core import AlgorithmGen, Recv, Send


def send(peer: int, buf: np.ndarray, step0: int = 0) -> AlgorithmGen:
    """Send ``buf`` to real rank ``peer``."""
    yield (Send(peer, buf, step0),)


def recv(peer: int, buf: np.ndarray, step0: int = 0) -> AlgorithmGen:
    """Receive into ``buf`` from real rank ``peer``."""
    yield (Recv(peer, buf, step0),)

"""The change digest a publisher keeps per bucket, so that it sends only what changed.

A 64-bit digest of a byte buffer: its 8-byte little-endian words ``w_k`` (the tail padded with
zero bytes), each mixed with its index ``k`` by a bijection of the word, summed modulo 2^64 and
finished with the length (``native/digest.c`` says why this shape). A change to any single word
always changes the digest; two independent changes collide with a chance of about 2^-64. It
detects training's changes, not an adversary's: a caller who must be sure passes
``digest=False`` and names what changed itself.

:func:`digest` runs the native core's ``digest`` (GIL released) and falls back to
:func:`reference_digest` where the core is not built; :func:`reference_digest` is the numpy
definition both must match bit for bit (``tests/test_weight_sync_plan.py``).
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np

from .. import native

_K1 = np.uint64(0x9E3779B185EBCA87)
_K2 = np.uint64(0xC2B2AE3D27D4EB4F)
_MASK = (1 << 64) - 1
_CHUNK_WORDS = 1 << 20
"""Words mixed at once by the reference: bounds its temporaries to a few MiB."""


def _finish(total: int, nbytes: int) -> int:
    h = (total ^ (nbytes * int(_K2))) & _MASK
    h ^= h >> 32
    h = (h * int(_K1)) & _MASK
    return h ^ (h >> 29)


def reference_digest(buffer: Any) -> int:
    """The digest of ``buffer``'s bytes, computed with numpy: the definition.

    Args:
        buffer: any C-contiguous object with the buffer protocol (a numpy array, bytes).

    Returns:
        The digest, an int in [0, 2^64).
    """
    data = np.frombuffer(memoryview(buffer).cast("B"), np.uint8)
    nbytes = data.size
    whole = nbytes // 8 * 8
    words = data[:whole].view("<u8")
    if nbytes % 8:
        tail = np.zeros(8, np.uint8)
        tail[:nbytes % 8] = data[whole:]
        words = np.concatenate([words, tail.view("<u8")])
    total = 0
    with np.errstate(over="ignore"):
        for start in range(0, words.size, _CHUNK_WORDS):
            chunk = words[start:start + _CHUNK_WORDS]
            index = np.arange(start, start + chunk.size, dtype=np.uint64)
            mixed = (chunk ^ (index * _K1)) * _K2
            mixed ^= mixed >> np.uint64(29)
            mixed *= _K1
            total = (total + int(mixed.sum(dtype=np.uint64))) & _MASK
    return _finish(total, nbytes)


def digest(buffer: Any) -> int:
    """The digest of ``buffer``'s bytes (the native core's where it is built).

    Args:
        buffer: a C-contiguous object with the buffer protocol.

    Returns:
        The digest, an int in [0, 2^64); equal to :func:`reference_digest`'s.
    """
    if native.available():
        return native.core().digest(buffer)
    return reference_digest(buffer)


def combine(digests: Iterable[int]) -> int:
    """One digest for a bucket made of several segments, from theirs in order.

    Args:
        digests: the segments' digests, in the bucket's order.

    Returns:
        The bucket's digest.
    """
    h = 0
    for d in digests:
        h = ((h * int(_K1)) + d) & _MASK
    return h

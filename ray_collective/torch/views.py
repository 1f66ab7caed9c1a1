"""The numpy arrays that ``all_reduce``'s short path hands the library, one per small tensor.

The library takes a torch CPU tensor as it takes a numpy array, but learns its layout (seven
calls into torch) and makes its numpy array (``detach().numpy()``, 1.4 µs) on every call: in a
group of one, ``col.allreduce`` of an 8 B tensor takes 3.9 µs, of its numpy array 1.2 µs. A
program reduces the same small tensor again and again (a metric, a flag, a buffer of its
own), so :class:`ArrayViews` keeps each small tensor's array and hands the library that
instead, checked on every call against what can change under the same tensor object
(``set_``, ``resize_``, ``.data =``, an in-place transpose): its address, byte count, dtype
and contiguity. The library requires of the ranks' calls the same dtype and element count,
not shape, so an array in the shape the tensor had is as good as one in its shape now. An
entry goes when its tensor does (a weak reference's callback), and the cache is bounded in
entries and in the size of a tensor it keeps.
"""

from __future__ import annotations

import weakref
from typing import Dict, Optional, Tuple

import numpy as np
import torch

VIEW_MAX_BYTES = 64 << 10
"""The largest tensor whose array is kept. An array holds its tensor's memory, which is no more
than the tensor holds, except where the tensor swapped its memory since (``set_``,
``.data =``): with :data:`VIEW_ENTRIES`, this bounds what that can pin (16 MiB a group)."""

VIEW_ENTRIES = 256
"""How many tensors' arrays one group keeps; past that it forgets them all and starts again."""

# The numpy array (None for a tensor numpy has no dtype for), and what it was made of:
# address, byte count, dtype.
_Entry = Tuple[weakref.ref, Optional[np.ndarray], int, int, torch.dtype]


class ArrayViews:
    """Small contiguous CPU tensors' numpy arrays, kept while each tensor lives."""

    def __init__(self, max_bytes: int = VIEW_MAX_BYTES, entries: int = VIEW_ENTRIES):
        self._max_bytes = max_bytes
        self._entries = entries
        self._by_id: Dict[int, _Entry] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def array(self, tensor: torch.Tensor) -> Optional[np.ndarray]:
        """The numpy array over ``tensor``'s memory, in its order of elements.

        Args:
            tensor: a tensor torch handed the backend.

        Returns:
            The array (kept for the next call), or None where ``tensor`` is not a small dense
            contiguous CPU tensor with a numpy dtype (bfloat16, say): the caller then hands
            the library the tensor itself.
        """
        entry = self._by_id.get(id(tensor))
        if (entry is not None and entry[0]() is tensor and tensor.data_ptr() == entry[2]
                and tensor.nbytes == entry[3] and tensor.dtype is entry[4]
                and tensor.is_contiguous()):
            return entry[1]
        return self._made(tensor)

    def _made(self, tensor: torch.Tensor) -> Optional[np.ndarray]:
        nbytes = tensor.nbytes
        if not (tensor.is_cpu and tensor.layout is torch.strided and tensor.is_contiguous()
                and nbytes <= self._max_bytes):
            return None
        try:
            # Of the detached tensor, which holds the memory, not the tensor object: an array
            # of the tensor itself would keep it alive, and its entry with it.
            array = tensor.detach().numpy()
        except (TypeError, RuntimeError):
            # No numpy dtype (bfloat16), or a lazy conjugate or negation: kept as None, so
            # that the next call does not pay for the exception again.
            array = None
        key = id(tensor)
        by_id = self._by_id
        if key not in by_id and len(by_id) >= self._entries:
            # All at once: taking the oldest out would iterate the dict, which another
            # thread's weak reference callback may change meanwhile.
            by_id.clear()
        by_id[key] = (weakref.ref(tensor, lambda _, key=key: by_id.pop(key, None)), array,
                      tensor.data_ptr(), nbytes, tensor.dtype)
        return array

    def clear(self) -> None:
        """Forget every array."""
        self._by_id.clear()

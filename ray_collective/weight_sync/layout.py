"""A member's state dict as weight sync sees it: the tensors' names, dtypes and shapes, their
bytes, and the fingerprint and description the members compare before any byte moves.

A state dict is a mapping of names (non-empty strings) to C-contiguous tensors: CPU tensors
(numpy arrays, torch CPU tensors) on the ``ray`` backend, GPU tensors of one kind on one GPU
(CuPy arrays, torch CUDA tensors) on ``nccl``; a subscriber's must be writable, since its
tensors are filled in place. Each member checks its own here (:func:`read_state_dict`); what it finds wrong becomes
its description's ``error``, which every member sees and raises, so that bad input on one member
is refused on all of them before anything is sent.

The description (:class:`Layout`) travels as JSON bytes, only when the fingerprints the members
exchange every sync do not match the plan they hold: a first sync, a changed state dict, or a
member that reports an error.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ..errors import ArgumentError
from ..tensors import TensorView, as_view


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a state dict: its name, dtype name (``"float32"``, ``"bfloat16"``...) and
    shape, and its size in bytes."""

    name: str
    dtype: str
    shape: Tuple[int, ...]
    nbytes: int

    def text(self) -> str:
        """How messages show it, e.g. ``float32[1024, 64]``."""
        return f"{self.dtype}{list(self.shape)}"


@dataclass(frozen=True)
class Layout:
    """What one member holds: its tensors sorted by name, or the error its input has."""

    tensors: Tuple[TensorSpec, ...] = ()
    error: str = ""

    def encode(self) -> bytes:
        """The JSON bytes the members exchange."""
        if self.error:
            return json.dumps({"error": self.error}).encode()
        return json.dumps({"tensors": [[t.name, t.dtype, list(t.shape), t.nbytes]
                                       for t in self.tensors]}).encode()

    @staticmethod
    def decode(data: bytes) -> "Layout":
        """The layout :meth:`encode` wrote."""
        fields = json.loads(data.decode())
        if "error" in fields:
            return Layout(error=fields["error"])
        return Layout(tuple(TensorSpec(name, dtype, tuple(shape), nbytes)
                            for name, dtype, shape, nbytes in fields["tensors"]))

    def fingerprint(self) -> Tuple[int, int]:
        """Two int64 words that differ, but for a 2^-128 chance, between different layouts."""
        digest = hashlib.blake2b(self.encode(), digest_size=16).digest()
        return (int.from_bytes(digest[:8], "little", signed=True),
                int.from_bytes(digest[8:], "little", signed=True))

    @property
    def nbytes(self) -> int:
        """The bytes of all its tensors."""
        return sum(t.nbytes for t in self.tensors)

    def by_name(self) -> Dict[str, TensorSpec]:
        """Its tensors by name."""
        return {t.name: t for t in self.tensors}


def read_state_dict(state_dict: Any, writable: bool, what: str, on_gpu: bool = False
                    ) -> Tuple[Layout, Dict[str, Any]]:
    """Check a member's state dict and take its tensors' memory.

    Args:
        state_dict: the caller's mapping of names to tensors.
        writable: whether the tensors are written (a subscriber's).
        what: how messages name the call, e.g. ``"publish_weights"``.
        on_gpu: whether the sync runs on the ``nccl`` backend (GPU tensors, all on one GPU)
            rather than ``ray`` (CPU tensors).

    Returns:
        ``(layout, memory)``: the layout (with ``error`` set and nothing else when the input
        is bad) and, for a good one, each name's tensor view (``TensorView``; on the GPU) or
        flat uint8 view sharing the tensor's memory (on the CPU).
    """
    if not isinstance(state_dict, Mapping):
        return Layout(error=f"{what}: state_dict must be a mapping of names to tensors, not "
                            f"{type(state_dict).__name__}"), {}
    specs: List[TensorSpec] = []
    memory: Dict[str, Any] = {}
    for name in state_dict:
        if not isinstance(name, str) or not name:
            return Layout(error=f"{what}: every key of state_dict must be a non-empty "
                                f"string, not {name!r}"), {}
    first = None
    for name in sorted(state_dict):
        try:
            view = as_view(state_dict[name], writable=writable, what=f"state_dict[{name!r}]")
        except ArgumentError as err:
            return Layout(error=f"{what}: {err}"), {}
        wrong = _wrong_place(view, first, name, what, on_gpu)
        if wrong:
            return Layout(error=wrong), {}
        first = first or (name, view)
        nbytes = view.count * view.wire_dtype.itemsize
        specs.append(TensorSpec(name, view.dtype_name, tuple(int(d) for d in view.shape),
                                int(nbytes)))
        memory[name] = view if on_gpu else view.array.view(np.uint8)
    if not specs:
        return Layout(error=f"{what}: state_dict is empty; pass at least one tensor"), {}
    return Layout(tuple(specs)), memory


def _wrong_place(view: TensorView, first: Optional[Tuple[str, TensorView]], name: str,
                 what: str, on_gpu: bool) -> str:
    """Why a tensor cannot be synced where this sync runs ("" when it can)."""
    tensor = f"state_dict[{name!r}]"
    if not on_gpu and view.array is None:
        return (f"{what}: {tensor} is a {view.kind} tensor on {view.device}; this weight sync "
                f"runs on the 'ray' backend, on the CPU: pass CPU tensors, or declare the sync "
                f"with backend='nccl' for GPU tensors")
    if on_gpu and view.array is not None:
        return (f"{what}: {tensor} is a {view.kind} tensor on the CPU; this weight sync runs "
                f"on the 'nccl' backend, which moves GPU memory: pass cupy arrays or torch "
                f"CUDA tensors, or declare the sync with backend='ray' for CPU tensors")
    if on_gpu and first is not None:
        other, like = first
        if (view.device, view.kind) != (like.device, like.kind):
            return (f"{what}: {tensor} is a {view.kind} tensor on {view.device} but "
                    f"state_dict[{other!r}] a {like.kind} tensor on {like.device}; a member's "
                    f"tensors must be of one kind on one GPU")
    return ""


def difference(expected: Layout, actual: Layout, expected_side: str, actual_side: str
               ) -> Optional[str]:
    """What differs between two layouts, naming the first tensor that does and both sides, or
    None where they are the same.

    Args:
        expected: the layout ``actual`` must equal (the publishers' model).
        actual: a member's.
        expected_side, actual_side: how the message names them, e.g. ``"the publishers"``,
            ``"subscriber 2"``.
    """
    want, have = expected.by_name(), actual.by_name()
    missing = sorted(set(want) - set(have))
    extra = sorted(set(have) - set(want))
    if missing:
        return (f"tensor {missing[0]!r} ({want[missing[0]].text()} in {expected_side}) is "
                f"missing from {actual_side}'s state_dict"
                + (f" ({len(missing)} tensors in all)" if len(missing) > 1 else ""))
    if extra:
        return (f"tensor {extra[0]!r} ({have[extra[0]].text()} in {actual_side}) is not in "
                f"{expected_side}' model"
                + (f" ({len(extra)} tensors in all)" if len(extra) > 1 else ""))
    for name in sorted(want):
        if want[name] != have[name]:
            return (f"tensor {name!r} is {want[name].text()} in {expected_side} but "
                    f"{have[name].text()} in {actual_side}")
    return None

"""The checks of a call's plain arguments (names, ranks, indices, deadlines, ops), shared by
every entry point: the collectives (``api``), the declarative ``*_refs`` collectives (``refs``)
and the multi-GPU calls (``backends.nccl.arguments``).

Each returns the value it accepted (normalised) or raises :class:`ArgumentTypeError` /
:class:`ArgumentValueError` with the argument's name, the value and what is valid; nothing has
been sent when they raise, so the group stays usable. What they let through works: a group
name of any accepted form, a world size up to ``MAX_WORLD_SIZE``, any deadline (one past
``MAX_TIMEOUT_S`` is taken as that).
"""

from __future__ import annotations

import math
import unicodedata
from typing import Any, Optional

from .errors import ArgumentTypeError, ArgumentValueError
from .types import (DEFAULT_TIMEOUT_S, MAX_GROUP_NAME_BYTES, MAX_TIMEOUT_S, MAX_WORLD_SIZE,
                    ReduceOp)


def check_group_name(group_name: Any) -> str:
    """``group_name`` if it is a non-empty string of at most ``MAX_GROUP_NAME_BYTES`` bytes of
    UTF-8 without control characters.

    Raises:
        ArgumentValueError: anything else (not a string, empty, too long, a control character
            such as NUL or a newline, a lone surrogate that UTF-8 cannot encode).
    """
    if not isinstance(group_name, str) or not group_name:
        raise ArgumentValueError(f"group_name must be a non-empty string, not {group_name!r}")
    try:
        size = len(group_name.encode("utf-8"))
    except UnicodeEncodeError:
        raise ArgumentValueError(
            f"group_name {group_name[:64]!r} is not valid text (UTF-8 cannot encode a lone "
            f"surrogate); use a name of printable characters") from None
    if size > MAX_GROUP_NAME_BYTES:
        raise ArgumentValueError(
            f"group_name is {size} bytes long in UTF-8 (it begins {group_name[:32]!r}); at most "
            f"{MAX_GROUP_NAME_BYTES} are allowed")
    control = next((c for c in group_name if unicodedata.category(c) == "Cc"), None)
    if control is not None:
        raise ArgumentValueError(
            f"group_name {group_name[:64]!r} holds the control character {control!r}; a name "
            f"may hold any printable characters, spaces and slashes included")
    return group_name


def _positive_number(value: Any, what: str, unit: str = "seconds") -> float:
    """``value`` as a float, if it is a finite positive number (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value <= 0:
        raise ArgumentValueError(f"{what} must be a positive number of {unit}, not {value!r}")
    return float(value)


def check_timeout(timeout: Any, what: str = "timeout") -> float:
    """``timeout`` as float seconds, if it is a finite positive number; one past
    ``MAX_TIMEOUT_S`` (a year: no practical limit) is taken as ``MAX_TIMEOUT_S``.

    Raises:
        ArgumentValueError: zero, negative, NaN, infinite, a bool or not a number.
    """
    return min(_positive_number(timeout, what), MAX_TIMEOUT_S)


def check_call_timeout(timeout: Any) -> Optional[float]:
    """A call's own deadline in seconds, or None when the call takes its group's.

    Raises:
        ArgumentValueError: given, and not a positive number.
    """
    return None if timeout is None else check_timeout(timeout)


def group_timeout(timeout: Any, gloo_timeout: Any) -> float:
    """A group's default deadline in seconds: ``timeout``, else ``gloo_timeout`` (milliseconds,
    as ``ray.util.collective`` takes it), else 1800 s; each checked when given, and taken as
    ``MAX_TIMEOUT_S`` beyond it.

    Raises:
        ArgumentValueError: either is not a positive number, or both are given and say
            different deadlines (``gloo_timeout`` counts milliseconds, ``timeout`` seconds).
    """
    if gloo_timeout is not None:
        milliseconds = _positive_number(gloo_timeout, "gloo_timeout", "milliseconds")
    if timeout is not None:
        seconds = check_timeout(timeout)
        in_seconds = None if gloo_timeout is None else min(milliseconds / 1000.0, MAX_TIMEOUT_S)
        if in_seconds is not None and abs(in_seconds - seconds) > 1e-9 * seconds:
            raise ArgumentValueError(
                f"gloo_timeout={gloo_timeout!r} (milliseconds, kept for ray.util.collective) "
                f"and timeout={timeout!r} (seconds) say different deadlines; pass only "
                f"timeout= (in seconds)")
        return seconds
    return DEFAULT_TIMEOUT_S if gloo_timeout is None else min(milliseconds / 1000.0,
                                                              MAX_TIMEOUT_S)


def check_index(value: Any, size: int, what: str, among: str) -> int:
    """``value`` if it is an int in ``0..size-1``.

    Args:
        value: the argument.
        size: how many there are.
        what: the argument's name (``dst_rank``, ``src_gpu_index``, ...).
        among: what ``size`` counts, for the message (``"group 'g' of 4 ranks"``).

    Raises:
        ArgumentTypeError: not an int (a bool is not one).
        ArgumentValueError: out of range.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgumentTypeError(f"{what} must be an int, not {type(value).__name__}")
    if not 0 <= value < size:
        raise ArgumentValueError(f"{what}={value} is out of range for {among} "
                                 f"(valid: 0..{size - 1})")
    return value


def check_rank(rank: Any, world_size: int, group_name: str, what: str = "rank") -> int:
    """``rank`` if it is a rank of a group of ``world_size`` ranks (see :func:`check_index`)."""
    return check_index(rank, world_size, what, f"group '{group_name}' of {world_size} ranks")


def check_world_size(world_size: Any) -> int:
    """``world_size`` if it is an int in ``1..MAX_WORLD_SIZE``.

    Raises:
        ArgumentValueError: anything else.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) \
            or not 1 <= world_size <= MAX_WORLD_SIZE:
        raise ArgumentValueError(f"world_size must be an int in 1..{MAX_WORLD_SIZE}, not "
                                 f"{world_size!r}")
    return world_size


def check_reduce_op(op: Any) -> ReduceOp:
    """``op`` as a :class:`ReduceOp`; ``ray.util.collective``'s members are taken by name.

    Raises:
        ArgumentTypeError: not a reduce op.
    """
    if isinstance(op, ReduceOp):
        return op
    name: Optional[str] = getattr(op, "name", None)
    if isinstance(name, str) and name in ReduceOp.__members__:
        return ReduceOp[name]
    raise ArgumentTypeError(
        f"op must be a ray_collective.ReduceOp (SUM, PRODUCT, MIN, MAX, AVG), not {op!r}")

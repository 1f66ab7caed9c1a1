"""Every environment variable the library reads, in one place, and its debug logger.

:data:`VARIABLES` lists each ``RAY_COLLECTIVE_*`` variable with its default, what it does and
the module that reads it (and when); ``docs/settings.md`` is that list as a page, and
``tests/test_first_hour_settings.py`` checks that the two and the source agree. The readers
stay beside what they configure (a variable read at each join can differ between two groups
of one process), so this module only names them.

The logger: every message the library logs goes to the logger ``ray_collective`` (:data:`LOGGER`)
and its children, at ``DEBUG``: each group's join (who, how long, the transport it got), the
algorithm chosen for each call shape, and each failure that breaks a group. Nothing is
logged unless the application enables that logger, or ``RAY_COLLECTIVE_LOG=debug`` is set in
the process (a member actor needs it in its ``runtime_env``), which this module reads once,
when ``ray_collective`` is imported: it then gives the logger a handler of its own on stderr
(and stops it propagating, so an application's root handler does not print every line
twice). Off, a message costs the check of the logger's level (a cached boolean) where a group
joins, fails or meets a new call shape, and nothing per call.
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass
from typing import Tuple

LOGGER_NAME = "ray_collective"
LOGGER = logging.getLogger(LOGGER_NAME)

LOG_VARIABLE = "RAY_COLLECTIVE_LOG"
LOG_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}


@dataclass(frozen=True)
class Variable:
    """One environment variable of the library.

    Attributes:
        name: the variable.
        default: its value when unset, as the page shows it.
        effect: what it does, and what it takes.
        read_by: the module that reads it, and when.
    """

    name: str
    default: str
    effect: str
    read_by: str


VARIABLES: Tuple[Variable, ...] = (
    Variable("RAY_COLLECTIVE_LOG", "unset (nothing logged)",
             "`debug` logs each group's join, each call shape's algorithm and each failure "
             "that breaks a group on the logger `ray_collective`, to stderr; `info` and "
             "`warning` set that level.",
             "`settings`, once, when `ray_collective` is imported"),
    Variable("RAY_COLLECTIVE_DIR", "`/dev/shm/ray_collective-<uid>` (or a private directory "
             "of its own if another user took that one)",
             "the directory of the `ray` backend's sockets and state pages on each node; "
             "must belong to this user, mode 0700.",
             "`backends.ray.private_dirs`, at each join"),
    Variable("RAY_COLLECTIVE_CROSS_NODE", "`streams`",
             "how a `ray` group that spans nodes moves messages between nodes: `streams` "
             "(TCP streams between ranks) or `object_store` (Ray's object store, through each "
             "node's post office; taken with `RAY_USE_TLS=1`). One rank asking for "
             "`object_store` takes the whole group there.",
             "`backends.ray.environment`, at each join"),
    Variable("RAY_COLLECTIVE_PURE_PYTHON", "unset (the native core where it was built)",
             "`1` runs a `ray` group's collectives on the pure-Python engine, not the C core; "
             "a group runs on the core only where every member can.",
             "`backends.ray.environment`, at each join"),
    Variable("RAY_COLLECTIVE_ALGORITHM", "unset (the selector chooses)",
             "`collective=algorithm[,...]` forces an algorithm per collective (tests, "
             "benchmarks); every rank of a group must force the same, which the join checks.",
             "`algorithms.selector`, at each join"),
    Variable("RAY_COLLECTIVE_TRACE_SIZE", "`256`",
             "the calls per group the flight recorder keeps (`get_collective_trace`, "
             "`error.trace`), 0 to 1048576; `0` turns the recorder and the metrics off.",
             "`recorder`, at each join"),
    Variable("RAY_COLLECTIVE_METRICS", "`1` where Ray can export metrics",
             "`0` turns the metrics off (no thread, no counting).",
             "`recorder`, at each join"),
    Variable("RAY_COLLECTIVE_READ_ONLY", "`write`",
             "what a collective does with a read-only array it must write: `write` "
             "(through a writable view, warned once) or `error`.",
             "`tensors`, when such an array arrives"),
)
"""Every ``RAY_COLLECTIVE_*`` variable the library reads."""


def configure_logging() -> None:
    """Give :data:`LOGGER` a stderr handler at the level ``RAY_COLLECTIVE_LOG`` names, once per
    process; nothing when it is unset or empty.

    Returns:
        None.
    """
    value = os.environ.get(LOG_VARIABLE, "").strip().lower()
    if not value or any(h.get_name() == LOG_VARIABLE for h in LOGGER.handlers):
        return
    level = LOG_LEVELS.get(value)
    if level is None:
        warnings.warn(f"{LOG_VARIABLE}={value!r} is not one of {sorted(LOG_LEVELS)}; "
                      f"nothing is logged", stacklevel=2)
        return
    handler = logging.StreamHandler()
    handler.set_name(LOG_VARIABLE)
    handler.setFormatter(logging.Formatter(
        "%(asctime)s %(name)s pid=%(process)d %(levelname)s %(message)s"))
    LOGGER.addHandler(handler)
    LOGGER.setLevel(level)
    LOGGER.propagate = False

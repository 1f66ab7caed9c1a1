"""batch_remote: call one method on many actors, validating and serializing the arguments once.

``actor.method.remote(arg)`` in a loop pays, per actor, Ray's Python call path (a new bound
method object, option defaults, argument flattening) and, for an argument larger than Ray's
inline limit (100 KiB by default), a fresh serialization and a fresh copy into the object store.
A :class:`BatchRemoteHandle` does the per-call work once per batch:

- the method is looked up and the arguments bound to its signature once per actor class, before
  anything is submitted, so a bad call submits nothing;
- every argument larger than the inline limit is put into the object store once, and the same
  ObjectRef goes to every actor (Ray resolves a top-level ObjectRef argument before the method
  runs, so the actors still receive values, as with a normal call);
- the options are resolved and the arguments flattened once, and each actor's task goes straight
  to Ray's core worker (``submit_actor_task``, the routine ``.remote()`` ends in).

Ray has no public batch-submission call (the proposal this module follows adds one to Ray's C++
core worker), so the last step reaches below ``ActorMethod.remote``. It is taken only when the
running Ray's ``submit_actor_task`` has exactly the parameters this module fills; otherwise, and
for calls that need the extra steps of the full path (a cross-language actor, a tracing
decorator, a tensor transport, streaming returns, tensors moved by the RDT transport), each
actor's call goes through ``.remote()``'s own path, keeping the single validation and put.
"""

from __future__ import annotations

import functools
import inspect
import os
from dataclasses import dataclass, replace
from typing import Any, Dict, Hashable, List, Mapping, Optional, Sequence, Tuple

import numpy as np

__all__ = ["BatchRemoteHandle", "PerActor", "batch_remote"]

RAY_DEFAULT_INLINE_LIMIT_BYTES = 100 * 1024
"""Ray's default ``max_direct_call_object_size``: larger arguments go through the object store."""

_OPTION_NAMES = ("name", "num_returns", "max_task_retries", "retry_exceptions",
                 "concurrency_group", "enable_task_events")


def inline_limit_bytes() -> int:
    """The argument size above which Ray passes an argument through the object store.

    Returns:
        ``RAY_max_direct_call_object_size`` from the environment when set, else Ray's default.
    """
    configured = os.environ.get("RAY_max_direct_call_object_size")
    return int(configured) if configured else RAY_DEFAULT_INLINE_LIMIT_BYTES


class PerActor:
    """An argument that differs per actor: actor i of the batch receives ``values[i]``.

    Everything else in a batch is the same for every actor; this is the one exception, for the
    argument that names each actor's own share (its rank, its shard, its ObjectRef). Its values
    are serialized actor by actor, so keep them small.

    Args:
        values: one value per actor of the batch, in the batch's order.
    """

    def __init__(self, values: Sequence[Any]):
        self.values = tuple(values)

    def __repr__(self) -> str:
        return f"PerActor({list(self.values)!r})"


@dataclass(frozen=True)
class _TaskOptions:
    """The task options of one batch (the keyword arguments of ``.options``), None: default."""

    name: str = ""
    num_returns: Any = None
    max_task_retries: Optional[int] = None
    retry_exceptions: Any = None
    concurrency_group: Optional[str] = None
    enable_task_events: Optional[bool] = None


_DIRECT_PARAMETERS = ("language", "actor_id", "function_descriptor", "args", "name",
                      "num_returns", "max_retries", "retry_exceptions",
                      "retry_exception_allowlist", "num_method_cpus", "concurrency_group_name",
                      "generator_backpressure_num_objects", "num_objects_per_yield",
                      "enable_task_events", "tensor_transport", "labels")
"""The parameters of Ray's ``CoreWorker.submit_actor_task`` this module knows how to fill (Ray
2.60). With any other parameter list, every call takes the full ``.remote()`` path."""

_PER_ACTOR_POSITIONS = {name: _DIRECT_PARAMETERS.index(name) for name in (
    "language", "actor_id", "function_descriptor", "args", "num_method_cpus")}


@functools.lru_cache(maxsize=1)
def _core_worker_speaks_direct_calls() -> bool:
    """Whether the running Ray's ``submit_actor_task`` takes exactly ``_DIRECT_PARAMETERS``."""
    from ray._raylet import CoreWorker
    try:
        parameters = list(inspect.signature(CoreWorker.submit_actor_task).parameters)
    except (TypeError, ValueError):
        return False
    return tuple(parameters[1:]) == _DIRECT_PARAMETERS


@dataclass(frozen=True)
class _DirectCall:
    """One actor class's method, resolved once for a batch: only the actor and the flattened
    arguments remain to be filled in per call.

    Attributes:
        method_name: the method.
        signature: the method's parameters, as Ray extracted them.
        positional: ``submit_actor_task``'s arguments in order, the per-actor ones None.
    """

    method_name: str
    signature: Sequence[Any]
    positional: tuple

    @staticmethod
    def resolve(actor: Any, method: Any, method_name: str, options: _TaskOptions
                ) -> Optional["_DirectCall"]:
        """Resolve the options of ``method`` as ``ActorMethod._remote`` does; None when the
        call needs the full path (cross-language actor, tracing decorator, tensor transport,
        a generator's streaming returns, or a Ray whose core worker takes other arguments)."""
        num_returns = method._num_returns if options.num_returns is None \
            else options.num_returns
        if actor._ray_is_cross_language or getattr(method, "_decorator", None) is not None \
                or getattr(method, "_tensor_transport", None) is not None \
                or isinstance(num_returns, bool) or not isinstance(num_returns, int) \
                or num_returns < 0 or not _core_worker_speaks_direct_calls():
            return None
        retries = method._max_task_retries if options.max_task_retries is None \
            else options.max_task_retries
        retry = method._retry_exceptions if options.retry_exceptions is None \
            else options.retry_exceptions
        allowlist = tuple(retry) if isinstance(retry, (list, tuple)) else None
        backpressure = method._generator_backpressure_num_objects
        events = method._enable_task_events if options.enable_task_events is None \
            else options.enable_task_events
        settings = {
            "name": options.name,
            "num_returns": num_returns,
            "max_retries": retries or 0,
            "retry_exceptions": allowlist is not None or bool(retry),
            "retry_exception_allowlist": allowlist,
            "concurrency_group_name": options.concurrency_group or b"",
            "generator_backpressure_num_objects": -1 if backpressure is None else backpressure,
            "num_objects_per_yield": getattr(method, "_num_objects_per_yield", None) or 1,
            "enable_task_events": events,
            "tensor_transport": None,
            "labels": None,
        }
        return _DirectCall(method_name, actor._ray_method_signatures[method_name],
                           tuple(settings.get(name) for name in _DIRECT_PARAMETERS))

    def flatten(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list:
        """The arguments in the flat form the core worker takes (Ray's own flattening)."""
        if not args and not kwargs:
            return []
        from ray import actor as ray_actor
        return ray_actor.signature.flatten_args(self.signature, args, kwargs)

    def submit(self, actor: Any, flat_args: list) -> Any:
        """Submit the call to ``actor``; returns what ``.remote()`` would (a ref, a list of
        refs, or None)."""
        import ray
        values = list(self.positional)
        values[_PER_ACTOR_POSITIONS["language"]] = actor._ray_actor_language
        values[_PER_ACTOR_POSITIONS["actor_id"]] = actor._ray_actor_id
        values[_PER_ACTOR_POSITIONS["function_descriptor"]] = \
            actor._ray_function_descriptor[self.method_name]
        values[_PER_ACTOR_POSITIONS["args"]] = flat_args
        values[_PER_ACTOR_POSITIONS["num_method_cpus"]] = actor._ray_actor_method_cpus
        refs = ray._private.worker.global_worker.core_worker.submit_actor_task(*values)
        if len(refs) == 1:
            return refs[0]
        return None if not refs else refs


class BatchRemoteHandle:
    """Calls one method on a list of actors at once: ``handle.method.remote(*args, **kwargs)``.

    ``handle.method.remote(...)`` returns the list of ObjectRefs in actor order (for a method
    with ``num_returns=k > 1``, each element is that actor's list of k refs; with 0, None).
    ``handle.method.options(name=..., num_returns=..., max_task_retries=...,
    retry_exceptions=..., concurrency_group=..., enable_task_events=...)`` sets task options for
    the whole batch. A :class:`PerActor` argument gives each actor its own value.

    Failure semantics: the method and the arguments are checked before anything is submitted,
    and a bad call raises there with nothing submitted. Submitting to an actor that has died
    does not raise: that actor's ref raises ``RayActorError`` on ``ray.get``, and the other
    actors' calls go ahead. An exception raised by the method in one actor is raised by that
    actor's ref only.

    Args:
        actors: the actor handles, in the order the results are returned (may repeat an actor).

    Raises:
        TypeError: ``actors`` is not a sequence of Ray actor handles.
        ValueError: ``actors`` is empty.
    """

    def __init__(self, actors: Sequence[Any]):
        if isinstance(actors, (str, bytes)) or not isinstance(actors, Sequence):
            raise TypeError(f"batch_remote takes a list of actor handles, not "
                            f"{type(actors).__name__}")
        if not actors:
            raise ValueError("batch_remote needs at least one actor handle")
        strangers = [a for a in actors if not hasattr(a, "_actor_method_call")]
        if strangers:
            raise TypeError(f"batch_remote takes Ray actor handles (made with "
                            f"ActorClass.remote()), not {type(strangers[0]).__name__}: "
                            f"{strangers[0]!r}")
        self._actors = tuple(actors)

    @property
    def actors(self) -> Tuple[Any, ...]:
        """The actor handles, in batch order."""
        return self._actors

    def __len__(self) -> int:
        return len(self._actors)

    def __getattr__(self, method_name: str) -> "BatchMethod":
        if method_name.startswith("__") and method_name != "__ray_call__":
            raise AttributeError(method_name)
        return BatchMethod(self._actors, method_name, _TaskOptions())

    def __repr__(self) -> str:
        return f"BatchRemoteHandle({len(self._actors)} actors)"


def batch_remote(actors: Sequence[Any]) -> BatchRemoteHandle:
    """A handle that calls a method on every actor of ``actors`` with one validation and one
    serialization of its arguments.

    Args:
        actors: Ray actor handles, in the order the results come back.

    Returns:
        A :class:`BatchRemoteHandle`; ``batch_remote(actors).method.remote(*args, **kwargs)``
        returns the list of ObjectRefs in actor order.

    Raises:
        TypeError: ``actors`` is not a sequence of actor handles.
        ValueError: ``actors`` is empty.
    """
    return BatchRemoteHandle(actors)


class BatchMethod:
    """One method of a batch, with its task options; ``.remote`` submits it to every actor."""

    def __init__(self, actors: Tuple[Any, ...], method_name: str, options: _TaskOptions):
        self._actors = actors
        self._method_name = method_name
        self._options = options

    def options(self, **options: Any) -> "BatchMethod":
        """The same method with task options for every actor's call.

        Args:
            **options: any of name, num_returns, max_task_retries, retry_exceptions,
                concurrency_group, enable_task_events.

        Returns:
            A method whose ``.remote`` applies them.

        Raises:
            TypeError: an option this handle does not know.
        """
        unknown = sorted(set(options) - set(_OPTION_NAMES))
        if unknown:
            raise TypeError(f"batch_remote(...).{self._method_name}.options() got unknown "
                            f"option(s) {unknown}; it takes {list(_OPTION_NAMES)}")
        return BatchMethod(self._actors, self._method_name, replace(self._options, **options))

    def remote(self, *args: Any, **kwargs: Any) -> List[Any]:
        """Submit the method to every actor of the batch.

        Args:
            *args, **kwargs: the method's arguments; large ones are put into the object store
                once; ObjectRefs are passed through; a :class:`PerActor` gives each actor its
                own value.

        Returns:
            The ObjectRefs of the calls, in actor order.

        Raises:
            AttributeError: an actor has no such method (nothing is submitted).
            TypeError: the arguments do not bind to the method's signature, or a
                :class:`PerActor` has not one value per actor (nothing is submitted).
        """
        per_actor = _per_actor_arguments(args, kwargs, len(self._actors))
        plans = self._plan(args, kwargs, per_actor)
        shared_args = [_put_if_large(value) for value in args]
        shared_kwargs = {key: _put_if_large(value) for key, value in kwargs.items()}
        full_path_options = self._full_path_options()
        flat_args: Dict[int, list] = {}
        refs = []
        for index, (actor, plan) in enumerate(zip(self._actors, plans)):
            call_args, call_kwargs = _with_actor_values(shared_args, shared_kwargs, per_actor,
                                                        index)
            if plan is None:
                method = getattr(actor, self._method_name)
                refs.append(method._remote(call_args, call_kwargs, **full_path_options))
                continue
            if per_actor or id(plan) not in flat_args:
                flat_args[id(plan)] = plan.flatten(call_args, call_kwargs)
            refs.append(plan.submit(actor, flat_args[id(plan)]))
        return refs

    def _plan(self, args: Sequence[Any], kwargs: Mapping[str, Any],
              per_actor: Mapping[Any, PerActor]) -> List[Optional["_DirectCall"]]:
        """Check the method and its arguments once per actor class, and resolve how each
        actor's call is submitted: a direct call, or None for the full ``.remote()`` path."""
        sample_args, sample_kwargs = _with_actor_values(args, kwargs, per_actor, 0)
        rdt_refs = _has_transport_managed_refs(list(sample_args) + list(sample_kwargs.values()))
        by_class: Dict[Hashable, Optional[_DirectCall]] = {}
        plans = []
        for actor in self._actors:
            key = _class_key(actor, self._method_name)
            if key not in by_class:
                if self._method_name not in actor._ray_method_signatures:
                    methods = sorted(name for name in actor._ray_method_signatures
                                     if not name.startswith("__"))
                    raise AttributeError(f"actor {actor!r} has no method "
                                         f"'{self._method_name}' (its methods: {methods}); "
                                         f"nothing was submitted")
                method = getattr(actor, self._method_name)
                _check_binds(method, self._method_name, sample_args, sample_kwargs)
                by_class[key] = None if rdt_refs else _DirectCall.resolve(
                    actor, method, self._method_name, self._options)
            plans.append(by_class[key])
        return plans

    def _full_path_options(self) -> Dict[str, Any]:
        options = self._options
        chosen = {field: getattr(options, field) for field in _OPTION_NAMES}
        return {field: value for field, value in chosen.items()
                if value is not None and not (field == "name" and value == "")}


def _class_key(actor: Any, method_name: str) -> Hashable:
    """Actors whose handles share this key share the method's signature and defaults."""
    descriptor = actor._ray_function_descriptor.get(method_name)
    return (method_name, repr(descriptor)) if descriptor is not None else (method_name, id(actor))


def _check_binds(method: Any, method_name: str, args: Sequence[Any],
                 kwargs: Mapping[str, Any]) -> None:
    parameters = [p for p in (method._signature or []) if p.name != "_ray_trace_ctx"]
    try:
        inspect.Signature(parameters=parameters).bind(*args, **kwargs)
    except TypeError as err:
        raise TypeError(f"batch_remote: the arguments do not fit {method_name}"
                        f"{inspect.Signature(parameters=parameters)}: {err}; nothing was "
                        f"submitted") from None


def _per_actor_arguments(args: Tuple[Any, ...], kwargs: Mapping[str, Any], count: int
                         ) -> Dict[Any, PerActor]:
    """The PerActor arguments, keyed by position or name, each checked to have ``count``
    values."""
    per_actor: Dict[Any, PerActor] = {}
    for key, value in list(enumerate(args)) + list(kwargs.items()):
        if isinstance(value, PerActor):
            if len(value.values) != count:
                raise TypeError(f"PerActor argument {key!r} has {len(value.values)} values for "
                                f"{count} actors; give exactly one per actor")
            per_actor[key] = value
    return per_actor


def _with_actor_values(args: Sequence[Any], kwargs: Mapping[str, Any],
                       per_actor: Mapping[Any, PerActor], index: int
                       ) -> Tuple[Sequence[Any], Mapping[str, Any]]:
    """Actor ``index``'s arguments: the shared ones themselves (never modified) when no
    argument is PerActor, else copies with its PerActor values in place."""
    if not per_actor:
        return args, kwargs
    call_args = [per_actor[i].values[index] if i in per_actor else value
                 for i, value in enumerate(args)]
    call_kwargs = {key: per_actor[key].values[index] if key in per_actor else value
                   for key, value in kwargs.items()}
    return call_args, call_kwargs


def _has_transport_managed_refs(values: Sequence[Any]) -> bool:
    """Whether an argument is a ref whose tensors Ray's RDT transport moves (full path only)."""
    import ray
    refs = [value for value in values if isinstance(value, ray.ObjectRef)]
    if not refs:
        return False
    manager = getattr(ray._private.worker.global_worker, "rdt_manager", None)
    if manager is None or not hasattr(manager, "is_managed_object"):
        return False
    return any(manager.is_managed_object(ref.hex()) for ref in refs)


def _put_if_large(value: Any) -> Any:
    """``value``, or one ObjectRef to it when Ray would copy it into the object store per call."""
    import ray
    if isinstance(value, (ray.ObjectRef, PerActor, ray.actor.ActorHandle)) or value is None:
        return value
    if _serialized_size(value) <= inline_limit_bytes():
        return value
    return ray.put(value)


def _serialized_size(value: Any) -> int:
    """Bytes Ray's serializer makes of ``value``.

    A buffer far from the inline limit is judged by its length alone; anything else is
    serialized once to be measured, since Ray's metadata decides an array whose data is just
    under the limit (a 100 KiB numpy array serializes to a little more than 100 KiB).
    """
    if isinstance(value, (int, float, bool, complex)):
        return 0
    length = _buffer_length(value)
    limit = inline_limit_bytes()
    if length is not None and not limit // 2 <= length <= 2 * limit:
        return length
    import ray
    context = ray._private.worker.global_worker.get_serialization_context()
    try:
        return context.serialize(value).total_bytes
    finally:
        context.get_and_clear_contained_object_refs()


def _buffer_length(value: Any) -> Optional[int]:
    """The data length of a numpy array or a bytes-like object, else None."""
    if isinstance(value, np.ndarray):
        return value.nbytes
    if isinstance(value, (bytes, bytearray)):
        return len(value)
    if isinstance(value, memoryview):
        return value.nbytes
    return None

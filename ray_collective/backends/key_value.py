"""The one wrapper of Ray's internal key-value store that every rendezvous of the library uses.

Keys are strings; values are strings or bytes. Everything lives in the namespace
:data:`NAMESPACE` (also the namespace of the library's named actors, the post offices), so the
library's keys never meet a user's.
"""

from __future__ import annotations

from typing import Any, List, Optional, Union

NAMESPACE = "ray_collective"


class KeyValue:
    """The part of Ray's internal key-value store the library uses.

    Args:
        store: the module with ``_internal_kv_put/_get/_del/_list``; default Ray's own
            (``ray.experimental.internal_kv``). Tests pass a stand-in.
    """

    def __init__(self, store: Optional[Any] = None):
        if store is None:
            from ray.experimental import internal_kv as store
        self._kv = store

    def initialized(self) -> bool:
        """Whether the store can be reached from this process (Ray is initialized)."""
        return bool(self._kv._internal_kv_initialized())

    def put(self, key: str, value: Union[str, bytes] = "", overwrite: bool = True) -> bool:
        """Store ``key``; returns whether it existed already."""
        data = value.encode() if isinstance(value, str) else bytes(value)
        return bool(self._kv._internal_kv_put(key.encode(), data, overwrite,
                                              namespace=NAMESPACE))

    def get_bytes(self, key: str) -> Optional[bytes]:
        """The value of ``key`` as stored, or None."""
        return self._kv._internal_kv_get(key.encode(), namespace=NAMESPACE)

    def get(self, key: str) -> Optional[str]:
        """The value of ``key`` as text, or None."""
        value = self.get_bytes(key)
        return None if value is None else value.decode()

    def keys(self, prefix: str) -> List[str]:
        """Every key starting with ``prefix``."""
        return [k.decode() for k in self._kv._internal_kv_list(prefix.encode(),
                                                                namespace=NAMESPACE)]

    def delete(self, key: str) -> None:
        """Delete ``key`` (nothing if it is not there)."""
        self._kv._internal_kv_del(key.encode(), namespace=NAMESPACE)

    def delete_prefix(self, prefix: str) -> None:
        """Delete every key starting with ``prefix``."""
        self._kv._internal_kv_del(prefix.encode(), del_by_prefix=True, namespace=NAMESPACE)

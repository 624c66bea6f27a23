"""One bounded map: the oldest entry goes when a new one would pass the limit.

Every per-user or per-chat map the daemon keeps in memory is one of these, so none grows with the
number of strangers who ever wrote (a cache of what is cheap to learn again, never of what must
not be forgotten).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Generic, TypeVar, overload

K = TypeVar("K")
V = TypeVar("V")
D = TypeVar("D")


class BoundedMap(Generic[K, V]):
    """A mapping of at most `limit` entries, oldest first out.

    `touch=True` makes it least-recently-*used*: a read or an overwrite moves the entry to the
    back. Invariant: `len(self) <= limit` after every call.
    """

    __slots__ = ("_data", "limit", "touch")

    def __init__(self, limit: int, *, touch: bool = False) -> None:
        if limit < 1:
            raise ValueError("a bounded map holds at least one entry")
        self.limit = limit
        self.touch = touch
        self._data: OrderedDict[K, V] = OrderedDict()

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def __iter__(self) -> Iterator[K]:
        return iter(self._data)

    def __getitem__(self, key: K) -> V:
        value = self._data[key]
        if self.touch:
            self._data.move_to_end(key)
        return value

    def __setitem__(self, key: K, value: V) -> None:
        data = self._data
        if key in data:
            data[key] = value
            data.move_to_end(key)
            return
        data[key] = value
        if len(data) > self.limit:
            data.popitem(last=False)

    def __delitem__(self, key: K) -> None:
        del self._data[key]

    @overload
    def get(self, key: K) -> V | None: ...

    @overload
    def get(self, key: K, default: D) -> V | D: ...

    def get(self, key: K, default: object = None) -> object:
        if key not in self._data:
            return default
        return self[key]

    @overload
    def pop(self, key: K) -> V | None: ...

    @overload
    def pop(self, key: K, default: D) -> V | D: ...

    def pop(self, key: K, default: object = None) -> object:
        return self._data.pop(key, default)

    def add(self, key: K, value: V) -> bool:
        """Insert unless present; True if `key` was already there (a de-duplication check)."""
        if key in self._data:
            return True
        self[key] = value
        return False

    def items(self) -> Iterator[tuple[K, V]]:
        return iter(self._data.items())

    def values(self) -> Iterator[V]:
        return iter(self._data.values())

    def clear(self) -> None:
        self._data.clear()

"""One holder for what a reload may change: readers keep the holder and read it when they need a
value; a reload replaces the value whole. Nothing reloadable is assigned onto a collaborator."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

T = TypeVar("T")
U = TypeVar("U")
T_co = TypeVar("T_co", covariant=True)


class Reads(Protocol[T_co]):
    """What a reader of reloadable settings holds: `Live` or a `LiveView` of one."""

    @property
    def value(self) -> T_co: ...


class Live(Generic[T]):
    """The current value of something a reload may replace.

    Invariant: a reader sees either the old value or the new one, never a mix — values are
    replaced whole (they are frozen dataclasses), and a turn that read a value keeps using it.
    """

    __slots__ = ("_value", "version")

    def __init__(self, value: T) -> None:
        self._value = value
        self.version = 0

    @property
    def value(self) -> T:
        return self._value

    def replace(self, value: T) -> None:
        """Only the daemon's reload calls this."""
        self._value = value
        self.version += 1

    def view(self, project: Callable[[T], U]) -> LiveView[U]:
        """A narrower holder for a reader that needs one part (computed once per value)."""
        return LiveView(self, project)


class LiveView(Generic[U]):
    """A projection of a `Live` value, recomputed only when the value is replaced."""

    __slots__ = ("_cached", "_project", "_source", "_version")

    def __init__(self, source: Live[Any], project: Callable[[Any], U]) -> None:
        self._source = source
        self._project = project
        self._version = -1
        self._cached: U | None = None

    @property
    def value(self) -> U:
        source = self._source
        if self._version != source.version:
            self._cached = self._project(source.value)
            self._version = source.version
        return self._cached  # type: ignore[return-value]


def fixed(value: T) -> Live[T]:
    """A holder nothing replaces (tests, benchmarks, a part built without a reload)."""
    return Live(value)

"""A configuration value as its field's type: one coercer per kind of type, looked up in a table.

TOML values arrive typed and are only checked; values from the environment or a secret file
(`from_env`) arrive as text and are parsed first (`"true"`, `"8080"`, `"a,b"`, `{"x": 1}`).
Every problem is a `ConfigError` naming the key (`where`).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any, Literal

from gateway.core.secrets import Secret

TRUE = frozenset({"1", "true", "yes", "on"})
FALSE = frozenset({"0", "false", "no", "off"})


class ConfigError(Exception):
    """A bad configuration value; the message names the key."""


def unknown(where: str, given: str, known: Iterable[str], what: str = "key") -> ConfigError:
    """"x.modle: unknown key (did you mean 'model'?)": a typo is named with its likely fix."""
    close = difflib.get_close_matches(given, sorted(known), n=1, cutoff=0.6)
    return ConfigError(f"{where}: unknown {what}" + (f" (did you mean {close[0]!r}?)" if close else ""))


# (where, value, hint, from_env) -> the value as `hint`
Coercer = Callable[[str, Any, Any, bool], Any]


def coerce(where: str, value: Any, hint: Any, *, from_env: bool) -> Any:
    """`value` as the type `hint`, or a ConfigError naming `where`."""
    return _coercer(where, hint)(where, value, hint, from_env)


def _coercer(where: str, hint: Any) -> Coercer:
    """Generic types by their origin (`list[str]` → list), plain types by themselves; a dataclass is
    a table of its own fields."""
    found = _BY_ORIGIN.get(typing.get_origin(hint)) or _BY_TYPE.get(hint)
    if found is not None:
        return found
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return _record
    raise ConfigError(f"{where}: unsupported type")  # pragma: no cover - a field type the schema should not use


def _optional(where: str, value: Any, hint: Any, from_env: bool) -> Any:
    """`X | None`: an empty environment value unsets it; anything else is an X."""
    if from_env and value == "":
        return None
    inner = [a for a in typing.get_args(hint) if a is not type(None)]
    return coerce(where, value, inner[0], from_env=from_env)


def _choice(where: str, value: Any, hint: Any, from_env: bool) -> Any:
    choices = typing.get_args(hint)
    if value not in choices:
        raise ConfigError(f"{where}: must be one of {', '.join(repr(a) for a in choices)} (got {value!r})")
    return value


def _list(where: str, value: Any, hint: Any, from_env: bool) -> list[Any]:
    """A list; from text, a JSON list or comma-separated values."""
    if from_env and isinstance(value, str):
        try:
            value = json.loads(value) if value.startswith("[") else [
                v.strip() for v in value.split(",") if v.strip()]
        except ValueError:
            raise ConfigError(f"{where}: must be a JSON list or comma-separated values") from None
    if not isinstance(value, list):
        raise ConfigError(f"{where}: must be a list")
    (inner,) = typing.get_args(hint)
    return [coerce(f"{where}[{i}]", v, inner, from_env=from_env) for i, v in enumerate(value)]


def _table(where: str, value: Any, hint: Any, from_env: bool) -> dict[str, Any]:
    """A TOML table of names to values; from text, a JSON object or comma-separated `name=value` pairs."""
    if from_env and isinstance(value, str):
        try:
            value = json.loads(value) if value.startswith("{") else dict(
                (name.strip(), v.strip()) for name, _, v in (p.partition("=") for p in value.split(",") if p.strip()))
        except ValueError:
            raise ConfigError(f"{where}: must be a JSON object or comma-separated name=value pairs") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: must be a table of names")
    inner = typing.get_args(hint)[1]
    return {str(k): coerce(f"{where}.{k}", v, inner, from_env=from_env) for k, v in value.items()}


def _record(where: str, value: Any, hint: Any, from_env: bool) -> Any:
    """A dataclass from a table in a list (`[[mcp.servers]]`): only TOML writes these, so its
    values are typed (never parsed from text)."""
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: must be a table")
    item = hint()
    hints = typing.get_type_hints(hint)
    for key, v in value.items():
        if key not in hints:
            raise unknown(f"{where}.{key}", key, hints)
        setattr(item, key, coerce(f"{where}.{key}", v, hints[key], from_env=False))
    return item


def _bool(where: str, value: Any, hint: Any, from_env: bool) -> bool:
    if from_env and isinstance(value, str) and value.lower() in TRUE | FALSE:
        return value.lower() in TRUE
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: must be true or false (got {value!r})")
    return value


def _number(where: str, value: Any, hint: Any, from_env: bool) -> int | float:
    """An int or a float. A bool is neither (TOML's `true` is not 1); an int is a float."""
    if from_env and isinstance(value, str):
        try:
            value = hint(value)
        except ValueError:
            raise ConfigError(f"{where}: must be a number (got {value!r})") from None
    if isinstance(value, bool) or not isinstance(value, int if hint is int else (int, float)):
        raise ConfigError(f"{where}: must be {'an integer' if hint is int else 'a number'} (got {value!r})")
    return typing.cast("int | float", hint(value))


def _secret(where: str, value: Any, hint: Any, from_env: bool) -> Secret:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: must be a non-empty string")
    return Secret(value)


def _string(where: str, value: Any, hint: Any, from_env: bool) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{where}: must be a string (got {value!r})")
    return value


_BY_ORIGIN: dict[Any, Coercer] = {typing.Union: _optional, types.UnionType: _optional, Literal: _choice,
                                  list: _list, dict: _table}
_BY_TYPE: dict[Any, Coercer] = {bool: _bool, int: _number, float: _number, Secret: _secret, str: _string}


def is_secret(hint: Any) -> bool:
    """Does a field of this type hold a secret (`Secret`, `Secret | None`, `list[Secret]`, …)?"""
    return Secret in (typing.get_args(hint) or (hint,)) or any(
        Secret in typing.get_args(a) for a in typing.get_args(hint))

"""``HarnessConfigError`` and the checks that raise it: a value against a config field's type hint (list -> tuple,
int -> float), a count that must be positive, an unknown key with its closest allowed match. Each message is one line
naming the file and the field.
"""
from __future__ import annotations

import difflib
import types
import typing
from typing import Any


class HarnessConfigError(ValueError):
    """A run configuration file or flag is invalid; the message is one line naming the field."""


def _positive(section: str, **vals: int | None) -> None:
    for k, v in vals.items():
        if v is not None and v < 1:
            raise HarnessConfigError(f"{section}.{k}: must be >= 1, got {v}")


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(hint))
    if typing.get_origin(hint) is tuple:
        return f"list of {_type_name(typing.get_args(hint)[0])}"
    return "null" if hint is type(None) else getattr(hint, "__name__", str(hint))


def _check(value: Any, hint: Any, where: str) -> Any:
    """Return ``value`` converted to ``hint`` (list -> tuple, int -> float) or raise naming ``where``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    got = "an empty value (null)" if value is None else f"{type(value).__name__} {value!r}"
    bad = HarnessConfigError(f"{where}: expected {_type_name(hint)}, got {got}")
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is not type(None):
                try:
                    return _check(value, a, where)
                except HarnessConfigError:
                    pass
        raise bad
    if origin is tuple:
        if isinstance(value, int) and not isinstance(value, bool):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise bad
        return tuple(_check(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
    if hint is Any:
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is int and isinstance(value, bool):
        raise bad
    if not isinstance(value, hint):
        raise bad
    return value


def _unknown(key: str, allowed: set[str], where: str) -> HarnessConfigError:
    close = difflib.get_close_matches(key, sorted(allowed), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else f" (allowed: {', '.join(sorted(allowed))})"
    return HarnessConfigError(f"{where}: unknown key {key!r}{hint}")

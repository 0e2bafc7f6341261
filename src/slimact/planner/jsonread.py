"""Reading a plan's JSON (``Plan.from_dict``): what is malformed is a ``ValueError`` naming it.

A saved plan is read by hand or by a program of the user's; a wrong shape (a rule that is not an
object, a layer missing a field, ``settings`` given as a list) must say which entry is wrong and
what it should hold, not surface as a ``KeyError`` or ``AttributeError`` from inside the reader.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import Any


def as_list(d: dict, key: str) -> list:
    """``d[key]`` (absent: ``[]``), a JSON list."""
    value = d.get(key, [])
    if not isinstance(value, list | tuple):
        raise ValueError(f"a plan's {key!r} is a list, got {value!r:.200}")
    return list(value)


def as_object(d: dict, key: str) -> dict:
    """``d[key]`` (absent: ``{}``), a JSON object."""
    value = d.get(key, {})
    if not isinstance(value, dict):
        raise ValueError(f"a plan's {key!r} is an object, got {value!r:.200}")
    return value


def read_entry(key: str, cls: type, convert: Callable[[dict], dict], entry: Any) -> Any:
    """One entry of a plan's ``key`` list (``layers``, ``rules``) as ``cls(**convert(entry))``;
    a malformed one (not an object, a field unknown or missing, a field of the wrong shape) a
    ``ValueError`` naming it and ``cls``'s fields."""
    try:
        if not isinstance(entry, dict):
            raise TypeError("not an object")
        return cls(**convert(entry))
    except (KeyError, TypeError) as e:
        valid = ", ".join(f.name for f in fields(cls))
        raise ValueError(
            f"a plan's {key!r} entry {entry!r:.200} is no {cls.__name__} ({type(e).__name__}: "
            f"{e}); its fields: {valid}"
        ) from e


__all__ = ["as_list", "as_object", "read_entry"]

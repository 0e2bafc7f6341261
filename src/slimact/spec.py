"""The one grammar of a strategy spec: ``parse("invact+int4@sr")`` -> a list of :class:`Part`.

A spec is parts joined by ``+``; a part is a strategy name, then optionally ``@`` and its
settings, comma-separated: ``auto@25%,codecs=int4/int8``, ``compiled-int8@0.25,sr``,
``chunked-ce@256,precompute``, ``prac@t1=20,svd=randomized``. Each setting has one spelling,
which ``str(part)`` prints back (``str(parse(s)[0])`` reads back to an equal part):

* ``key=value`` for every setting; a value listing several items joins them by ``/``
  (``codecs=int4/int8``);
* a memory budget bare (``25%``, ``6GiB``, ``123456B``: :func:`parse_budget`), at most one;
* stochastic rounding bare, ``sr`` (``rounding=stochastic`` is read as ``sr``);
* the settings a strategy writes bare (:data:`BARE`): ``chunked-ce``'s chunk size and mode,
  a ``compiled-*`` block strategy's compile region budget (a number in [0, 1]; so do the
  benchmark's anchors ``compile-budget@0.25`` and ``compile-block@0``).

An unkeyed item that is none of these is kept with the key ``""``, so :func:`settings` can name
it beside the valid choices. Parsing checks the form only; which settings a strategy takes and
their types are its config's (``spec_fields``), converted by :func:`settings` and built by
:func:`configure`. Nothing else in ``slimact`` splits a spec or parses a budget
(``tests/test_spec.py``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from slimact.budget import Budget

SEP = "+"  # between parts
AT = "@"  # between a part's name and its settings
SR = "sr"  # stochastic rounding, the one spelling of rounding=stochastic
COMPILED_PREFIX = "compiled-"  # the strategies of compiled blocks (``slimact.compiled``)

_NUMBER = re.compile(r"^[-+]?[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?$", re.IGNORECASE)
_SIZED = re.compile(r"^[-+]?[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?\s*[a-z%]+$", re.IGNORECASE)
_CE_MODES = ("recompute", "precompute")


def _is_number(text: str) -> bool:
    return bool(_NUMBER.match(text))


# the settings written bare, by strategy: (key, does the item name it, what it is)
BareSetting = tuple[str, Callable[[str], bool], str]
_CHUNKED_CE: tuple[BareSetting, ...] = (
    ("chunk_size", str.isdigit, "a chunk size (an int)"),
    ("mode", _CE_MODES.__contains__, f"a mode ({', '.join(_CE_MODES)})"),
)
_ANCHORS = ("compile-budget", "compile-block")  # the benchmark's anchors of compile's budget
_REGION: tuple[BareSetting, ...] = (
    ("region", _is_number, "compile's region budget, a number in [0, 1]"),
)


def bare_settings(name: str) -> tuple[BareSetting, ...]:
    """The settings strategy ``name`` writes bare (:data:`BARE`)."""
    if name == "chunked-ce":
        return _CHUNKED_CE
    if name.startswith(COMPILED_PREFIX) and name != "compiled-auto" or name in _ANCHORS:
        return _REGION
    return ()


BARE = bare_settings  # what a bare item of a part names


@dataclass(frozen=True)
class Part:
    """One part of a spec: ``name``, its ``settings`` as (key, value text) in the order given
    (one spelling each; key ``""``: an unkeyed item no setting takes) and its ``budget``."""

    name: str
    settings: tuple[tuple[str, str], ...] = ()
    budget: Budget | None = None

    def get(self, key: str, default: str | None = None) -> str | None:
        return dict(self.settings).get(key, default)

    def with_settings(self, **more: str) -> Part:
        """This part with ``more`` settings added where it does not set them already."""
        given = {k for k, _ in self.settings}
        extra = tuple((k, v) for k, v in more.items() if k not in given)
        return dataclasses.replace(self, settings=(*self.settings, *extra))

    def __str__(self) -> str:
        bare = {key: test for key, test, _ in bare_settings(self.name)}
        items = [] if self.budget is None else [str(self.budget)]
        for key, value in self.settings:
            if key == "rounding" and value == "stochastic":
                items.append(SR)
            elif not key or (key in bare and bare[key](value)):
                items.append(value)  # bare where it reads back as the same setting
            else:
                items.append(f"{key}={value}")
        return f"{self.name}{AT}{','.join(items)}" if items else self.name


def parse_budget(value: str | int | Budget) -> Budget:
    """A memory budget: ``"25%"`` of the baseline, ``"6GiB"``, ``"123456B"`` or an int of bytes
    (``slimact.budget``); a bad one is a ``ValueError`` naming it."""
    return Budget.parse(value)


def parse_part(text: str, spec: str | None = None) -> Part:
    """One part, ``name[@setting,...]`` (module docstring); ``spec``: the whole spec, for errors."""
    where = repr(spec if spec is not None else text)
    name, at, body = (x.strip() for x in text.partition(AT))
    if not name:
        raise ValueError(f"strategy {where} has a part without a name: {text!r}")
    items = [item.strip() for item in body.split(",")] if at else []
    if at and not any(items):
        raise ValueError(
            f"strategy spec {where}: the settings after '{AT}' are empty (''); write "
            f"'{name}' or '{name}{AT}<setting>,...'"
        )
    bare = bare_settings(name)
    settings: list[tuple[str, str]] = []
    budget = None
    for item in filter(None, items):
        key, eq, value = (x.strip() for x in item.partition("="))
        if eq:
            pass
        elif item == SR:
            key, value = "rounding", "stochastic"
        elif (hit := next((k for k, test, _ in bare if test(item)), None)) is not None:
            key, value = hit, item
        elif _SIZED.match(item):
            if budget is not None:
                raise ValueError(f"strategy spec {where}: two budgets, {budget} and {item!r}")
            budget = parse_budget(item)
            continue
        else:
            key, value = "", item
        if key and any(key == k for k, _ in settings):
            raise ValueError(f"strategy spec {where}: {key} is given twice")
        settings.append((key, value))
    return Part(name, tuple(settings), budget)


def parse(spec: str, names: Iterable[str] = ()) -> list[Part]:
    """``"invact+int4@sr"`` -> its parts; ``names``: the valid strategy names, for errors."""
    valid = f"; valid strategies: {', '.join(names)}" if names else ""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"a strategy spec is a non-empty string, got {spec!r}{valid}")
    texts = [t.strip() for t in spec.split(SEP)]
    if not all(texts):
        raise ValueError(
            f"strategy {spec!r} has an empty part: join names with single '{SEP}' "
            f"(e.g. 'invact{SEP}int4'){valid}"
        )
    return [parse_part(t, spec) for t in texts]


def join(parts: Iterable[Part | str]) -> str:
    """Parts as one spec (``parse``'s inverse)."""
    return SEP.join(str(p) for p in parts)


def names(spec: str) -> list[str]:
    """The strategy names of ``spec``'s parts."""
    return [p.name for p in parse(spec)]


def compiles_blocks(spec: str) -> bool:
    """Does ``spec`` name a ``compiled-*`` strategy (blocks compiled with their actions)?"""
    return any(n.startswith(COMPILED_PREFIX) for n in names(spec))


# -- settings: text -> typed values ---------------------------------------------------------------


def flag(text: str) -> bool:
    low = text.lower()
    if low not in ("1", "0", "true", "false", "yes", "no"):
        raise ValueError(text)
    return low in ("1", "true", "yes")


flag.__name__ = "true or false"


def optional(conv: Callable[[str], Any]) -> Callable[[str], Any]:
    """``none`` -> None, else ``conv``."""

    def read(text: str) -> Any:
        return None if text.lower() == "none" else conv(text)

    read.__name__ = f"{getattr(conv, '__name__', 'a value')} or none"
    return read


def listed(conv: Callable[[str], Any] = str, empty: str | None = None) -> Callable[[str], tuple]:
    """Items joined by ``/`` (``int4/int8``) -> a tuple; ``empty``: the word for no items."""

    def read(text: str) -> tuple:
        if empty is not None and text.lower() == empty:
            return ()
        return tuple(conv(x.strip()) for x in text.split("/") if x.strip())

    read.__name__ = f"{getattr(conv, '__name__', 'value')}s joined by '/'"
    return read


Fields = Mapping[str, Callable[[str], Any]]


def _forms(part: Part, fields: Fields, takes_budget: bool) -> str:
    forms = [what for key, _, what in bare_settings(part.name) if key in fields]
    if takes_budget:
        forms.insert(0, "a budget ('25%', '6GiB')")
    if "rounding" in fields:
        forms.append(f"'{SR}'")
    keyed = f"key=value with key one of {', '.join(fields)}" if fields else ""
    return " or ".join([*forms, keyed]) if keyed or forms else "nothing (it takes no settings)"


def settings(part: Part, fields: Fields, takes_budget: bool = False) -> dict[str, Any]:
    """``part``'s settings as typed values, by ``fields`` (key -> a function reading the text;
    its ``__name__`` says what it reads), and its budget as ``budget`` where it takes one. A
    setting it does not take or a value its reader refuses is a ``ValueError`` naming the bad
    item and the valid choices."""
    spec = str(part)
    out: dict[str, Any] = {}
    if part.budget is not None:
        if not takes_budget:
            raise ValueError(
                f"strategy spec {spec!r}: {part.name} takes no budget ({part.budget}); "
                f"its settings: {_forms(part, fields, False)}"
            )
        out["budget"] = part.budget
    for key, value in part.settings:
        if not key:
            if takes_budget and _is_number(value):
                parse_budget(value)  # a number without a unit: the budget's own message
            raise ValueError(
                f"strategy spec {spec!r}: {value!r} must be {_forms(part, fields, takes_budget)}"
            )
        read = fields.get(key)
        if read is None:
            raise ValueError(
                f"strategy spec {spec!r}: unknown option {key!r}: {key + '=' + value!r} must be "
                f"{_forms(part, fields, takes_budget)}"
            )
        try:
            out[key] = read(value)
        except ValueError:
            what = getattr(read, "__name__", "a valid value")
            raise ValueError(
                f"strategy spec {spec!r}: bad value for {key}: {key} must be {what}, got {value!r}"
            ) from None
    return out


def configure(default: Any, part: Part) -> Any:
    """The config ``part`` names: ``default`` (its strategy's registered config) with the part's
    settings, read by the config class's ``spec_fields`` (and its budget where the class has
    ``spec_budget``), through the class's ``from_settings(default, values)`` where it has one,
    else ``dataclasses.replace``. A part with no settings is ``default`` itself."""
    if not part.settings and part.budget is None:
        return default
    cls = type(default)
    fields = getattr(cls, "spec_fields", None)
    if fields is None:
        raise ValueError(f"strategy spec {str(part)!r}: {part.name} takes no settings")
    values = settings(part, fields, getattr(cls, "spec_budget", False))
    build = getattr(cls, "from_settings", None)
    return build(default, values) if build is not None else dataclasses.replace(default, **values)


__all__ = [
    "AT",
    "BARE",
    "COMPILED_PREFIX",
    "SEP",
    "SR",
    "Part",
    "compiles_blocks",
    "configure",
    "flag",
    "join",
    "listed",
    "names",
    "optional",
    "parse",
    "parse_budget",
    "parse_part",
    "settings",
]

"""A plan's settings: how each family of its actions computes, beside which sites take them.

A ``Plan`` names what it does module by module (which modules it recomputes, which it
reformulates and with which kind); how a *family* of those actions computes is one typed setting
per plan (``Plan.settings``: family -> settings), the same for every module of the family:

    recompute    ``RecomputeSettings``: ``preserve_rng_state``, for every recomputation of the
                 plan: the modules it recomputes and its block reformulations (the block itself
                 reformulated, ``cola-m``, which recomputes inside)
    invact       ``InvActSettings``: how the inverted activations and norms (reform kinds
                 ``invact:*``, ``invnorm:*``) compute: ``InvActConfig``'s fields but its module
                 selection (``ops``, ``norms``) and its ``probe``
    chunked-ce   ``ChunkedCESettings``: the chunked loss head's (kind ``chunked-ce``) chunk size,
                 mode and backend: ``ChunkedCEConfig``'s fields but its ``probe``

A family the plan does not name runs with its defaults (``Plan.setting(family)``); a plan keeps
only the settings that differ from them, so equal plans compare equal. Settings are validated
as their strategy's config is (``InvActSettings(bf16="x")`` raises what ``InvActConfig`` does),
and ``config()`` gives the config the plan runtime reformulates with (``probe=False``: the plan
already names the modules).

JSON, as torchao serializes its configs: each family's setting as ``{"_type": class name,
"_data": its fields}`` (``settings_to_dict``, ``settings_from_dict``). A plan saved without
settings loads with every family's defaults, and a field absent from ``_data`` (a setting added
after the plan was saved) takes its default; an unknown family, type or field is refused, since
a plan must not run with a setting silently dropped.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

from slimact.reformulate import ChunkedCEConfig, InvActConfig


class _FromConfig:
    """Settings read from (``of``) and turned into (``config``) their strategy's config."""

    config_type: ClassVar[type]

    def __post_init__(self) -> None:
        self.config()  # the config's own validation, with its message

    @classmethod
    def of(cls, config: Any) -> Any:
        """The settings ``config`` reformulates with (its module selection left out)."""
        return cls(**{f.name: getattr(config, f.name) for f in fields(cls)})

    def config(self, **kwargs: Any) -> Any:
        return self.config_type(**asdict(self), **kwargs)


@dataclass(frozen=True)
class RecomputeSettings:
    """Every recomputation of the plan (its recomputed modules, its block reformulations)."""

    family: ClassVar[str] = "recompute"
    reform_kinds: ClassVar[tuple[str, ...]] = ()  # (block reformulations: see Plan.uses)

    preserve_rng_state: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.preserve_rng_state, bool):
            raise ValueError(f"preserve_rng_state must be a bool, got {self.preserve_rng_state!r}")


@dataclass(frozen=True)
class InvActSettings(_FromConfig):
    """How the inverted activations and norms compute (``InvActConfig``'s fields)."""

    family: ClassVar[str] = "invact"
    reform_kinds: ClassVar[tuple[str, ...]] = ("invact", "invnorm")
    config_type: ClassVar[type] = InvActConfig

    mode: str = InvActConfig.mode
    variant: str = InvActConfig.variant
    max_bias_ratio: float = InvActConfig.max_bias_ratio
    backend: str = InvActConfig.backend
    bf16: str = InvActConfig.bf16


@dataclass(frozen=True)
class ChunkedCESettings(_FromConfig):
    """How the chunked loss head computes (``ChunkedCEConfig``'s fields)."""

    family: ClassVar[str] = "chunked-ce"
    reform_kinds: ClassVar[tuple[str, ...]] = ("chunked-ce",)
    config_type: ClassVar[type] = ChunkedCEConfig

    chunk_size: int | None = ChunkedCEConfig.chunk_size
    mode: str = ChunkedCEConfig.mode
    backend: str = ChunkedCEConfig.backend


Settings = RecomputeSettings | InvActSettings | ChunkedCESettings
FAMILIES: dict[str, type] = {
    cls.family: cls for cls in (RecomputeSettings, InvActSettings, ChunkedCESettings)
}


def default(family: str) -> Any:
    """``family``'s default settings."""
    if family not in FAMILIES:
        raise ValueError(f"no settings family {family!r}; families: {', '.join(FAMILIES)}")
    return FAMILIES[family]()


def normalize(settings: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> tuple[tuple[str, Any]]:
    """(family, settings) pairs, each of its family's type, defaults left out, sorted by family."""
    pairs = list(settings.items() if isinstance(settings, Mapping) else settings)
    out: dict[str, Any] = {}
    for family, value in pairs:
        cls = FAMILIES.get(family)
        if cls is None:
            raise ValueError(f"no settings family {family!r}; families: {', '.join(FAMILIES)}")
        if type(value) is not cls:
            raise ValueError(
                f"settings of family {family!r} are a {cls.__name__}, not {type(value).__name__}"
            )
        if family in out and out[family] != value:
            raise ValueError(f"two settings for family {family!r}: {out[family]} and {value}")
        out[family] = value
    return tuple((f, v) for f, v in sorted(out.items()) if v != FAMILIES[f]())


def differences(value: Any) -> str:
    """The fields where ``value`` differs from its family's defaults: ``bf16='exact-near-branch'``."""
    base = type(value)()
    diff = [f.name for f in fields(value) if getattr(value, f.name) != getattr(base, f.name)]
    return ", ".join(f"{k}={getattr(value, k)!r}" for k in diff) or "defaults"


def settings_to_dict(settings: Iterable[tuple[str, Any]]) -> dict[str, dict]:
    """``{family: {"_type": class name, "_data": fields}}`` (module docstring)."""
    return {f: {"_type": type(v).__name__, "_data": asdict(v)} for f, v in settings}


def settings_from_dict(d: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    """``settings_to_dict``'s inverse; a field ``_data`` lacks takes its default."""
    pairs = []
    for family, entry in d.items():
        cls = FAMILIES.get(family)
        if cls is None:
            raise ValueError(
                f"plan settings: no family {family!r}; families: {', '.join(FAMILIES)}"
            )
        if not isinstance(entry, Mapping) or entry.get("_type") != cls.__name__:
            raise ValueError(
                f"plan settings of {family!r}: expected {{'_type': {cls.__name__!r}, '_data': "
                f"{{...}}}}, got {entry!r}"
            )
        data = entry.get("_data", {})
        if not isinstance(data, Mapping):
            raise ValueError(
                f"plan settings of {family!r}: '_data' is an object of fields, got {data!r}"
            )
        valid = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(valid))
        if unknown:
            raise ValueError(
                f"plan settings of {family!r}: unknown field(s) {unknown}; {cls.__name__}'s "
                f"fields: {', '.join(valid)}"
            )
        pairs.append((family, cls(**dict(data))))
    return normalize(pairs)


__all__ = [
    "FAMILIES",
    "ChunkedCESettings",
    "InvActSettings",
    "RecomputeSettings",
    "Settings",
    "default",
    "differences",
    "normalize",
    "settings_from_dict",
    "settings_to_dict",
]

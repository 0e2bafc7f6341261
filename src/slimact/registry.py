"""Strategy registry: a name or a typed config maps to a transform of the model.

torchao-style: each strategy is a frozen dataclass config; ``register_strategy`` ties a name and a
config class to ``transform(model, config, filter_fn) -> AppliedChange list``. ``apply`` accepts
``"name"``, a config, ``"name@arg"`` for configs with a ``from_spec`` parser (``"auto@25%"``), or
``"a+b"`` to compose several (applied left to right). Every change is
recorded on the model (``applied(model)``) and can be undone with ``revert(model)``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch.nn as nn

logger = logging.getLogger("slimact")

FilterFn = Callable[[nn.Module, str], bool]


@dataclass(frozen=True)
class StrategyConfig:
    """Base class of strategy configs. Subclasses are frozen dataclasses validated in __post_init__."""

    @property
    def name(self) -> str:
        for name, entry in _REGISTRY.items():
            if type(self) is entry.config_cls and entry.default == self:
                return name
        for name, entry in _REGISTRY.items():
            if type(self) is entry.config_cls:
                return name
        return type(self).__name__


@dataclass
class AppliedChange:
    """What a transform did to one module: ``action`` (e.g. 'recompute'), or ``skipped`` + why."""

    path: str
    action: str
    detail: str = ""
    skipped: bool = False
    undo: Callable[[], None] | None = field(default=None, repr=False, compare=False)


Transform = Callable[[nn.Module, StrategyConfig, FilterFn | None], list[AppliedChange]]


@dataclass(frozen=True)
class _Entry:
    config_cls: type
    default: StrategyConfig
    transform: Transform
    description: str


_REGISTRY: dict[str, _Entry] = {}


def register_strategy(
    name: str, default: StrategyConfig, transform: Transform, description: str = ""
) -> None:
    """Register ``name``. Registering the same name again from the same transform (a module that
    is imported a second time, e.g. after an earlier import of the package failed half-way)
    replaces the entry; a different transform under a taken name is an error."""
    old = _REGISTRY.get(name)
    if old is not None and _qualname(old.transform) != _qualname(transform):
        raise ValueError(
            f"strategy {name!r} is already registered by {_qualname(old.transform)}; "
            f"cannot register it again for {_qualname(transform)}"
        )
    _REGISTRY[name] = _Entry(type(default), default, transform, description)


def _qualname(fn: Callable[..., object]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def unregister_strategies(names: set[str]) -> None:
    """Drop ``names`` from the registry (used to undo a half-finished import)."""
    for name in names:
        _REGISTRY.pop(name, None)


def strategy_names() -> list[str]:
    return list(_REGISTRY)


def describe_strategies() -> dict[str, str]:
    return {n: e.description for n, e in _REGISTRY.items()}


def resolve(strategy: str | StrategyConfig) -> list[StrategyConfig]:
    """``"none"``, ``"invact+int4"`` or a config -> list of configs."""
    if isinstance(strategy, StrategyConfig):
        return [strategy]
    if not isinstance(strategy, str) or not strategy.strip():
        raise ValueError(
            f"strategy must be a name or a StrategyConfig, got {strategy!r}; "
            f"valid names: {', '.join(_REGISTRY)}"
        )
    out = []
    for part in strategy.split("+"):
        part = part.strip()
        base = part.split("@", 1)[0]
        if part in _REGISTRY:
            out.append(_REGISTRY[part].default)
        elif base in _REGISTRY and hasattr(_REGISTRY[base].config_cls, "from_spec"):
            out.append(_REGISTRY[base].config_cls.from_spec(part))  # e.g. "auto@30%"
        else:
            raise ValueError(f"unknown strategy {part!r}; valid strategies: {', '.join(_REGISTRY)}")
    return out


def with_budget(strategy: str, budget: str | None) -> str:
    """``("auto", "25%") -> "auto@25%"``: the ``--budget`` flag of the CLIs, for every ``auto``."""
    if budget is None:
        return strategy
    parts = [p.strip() for p in strategy.split("+")]
    if "auto" not in parts:
        raise ValueError(f"--budget {budget} applies to strategy 'auto', not to {strategy!r}")
    return "+".join(f"auto@{budget}" if p == "auto" else p for p in parts)


def _entry_for(config: StrategyConfig) -> _Entry:
    for entry in _REGISTRY.values():
        if type(config) is entry.config_cls:
            return entry
    raise ValueError(f"no strategy is registered for config type {type(config).__name__}")


def apply(
    model: nn.Module, strategy: str | StrategyConfig, filter_fn: FilterFn | None = None
) -> nn.Module:
    """Apply a strategy to ``model`` in place and return it; the changes are logged and recorded.

    ``filter_fn(module, path) -> bool`` restricts which modules a transform may touch.
    """
    configs = resolve(strategy)
    log: list[AppliedChange] = model.__dict__.setdefault("_slimact_applied", [])
    for cfg in configs:
        changes = _entry_for(cfg).transform(model, cfg, filter_fn)
        log.extend(changes)
        done = [c for c in changes if not c.skipped]
        skipped = [c for c in changes if c.skipped]
        logger.info("slimact.apply %s: %d change(s), %d skipped", cfg.name, len(done), len(skipped))
        for c in changes:
            logger.debug("  %s %s %s", "skip" if c.skipped else c.action, c.path, c.detail)
    return model


def applied(model: nn.Module) -> list[AppliedChange]:
    """The changes ``apply`` made to ``model`` (skipped sites included, with their reasons)."""
    return list(model.__dict__.get("_slimact_applied", []))


def revert(model: nn.Module) -> nn.Module:
    """Undo every change ``apply`` made, newest first."""
    for change in reversed(model.__dict__.pop("_slimact_applied", [])):
        if change.undo is not None:
            change.undo()
    return model

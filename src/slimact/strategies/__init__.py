"""Strategies: named, typed presets (a strategy as a plan) that give sites an action (keep,
recompute, codec, reformulate, offload).

``none`` and ``recompute`` are registered here; every other module in this package registers its
own strategies when imported, and all of them are imported below, so adding a strategy is adding
a file.
"""

import importlib
import pkgutil

from slimact.registry import (
    AppliedChange,
    FilterFn,
    StrategyConfig,
    applied,
    apply,
    describe_strategies,
    register_strategy,
    resolve,
    revert,
    strategy_names,
    unregister_strategies,
)
from slimact.strategies.none import NoneConfig, none_part
from slimact.strategies.recompute import RecomputeConfig, recompute_part


def _register_all() -> None:
    """Register every strategy, or none: a module that fails to import (a missing dependency)
    takes back what this import registered and its own error propagates unchanged."""
    before = set(strategy_names())
    try:
        register_strategy(
            "none",
            NoneConfig(),
            description="baseline: keep every saved tensor",
            preset=none_part,
            compiled_form="compiled-none",
        )
        register_strategy(
            "recompute",
            RecomputeConfig(),
            description="non-reentrant checkpointing of every block",
            preset=recompute_part,
            compiled_form="compiled-recompute",  # compile's partitioner at region budget 0
        )
        for mod in pkgutil.iter_modules(__path__):
            if mod.name not in ("registry", "recompute", "none"):
                importlib.import_module(f"{__name__}.{mod.name}")
        importlib.import_module("slimact.compiled")  # compiled-none/-int8/-int4/...
    except BaseException:
        unregister_strategies(set(strategy_names()) - before)
        raise


_register_all()

__all__ = [
    "AppliedChange",
    "FilterFn",
    "NoneConfig",
    "RecomputeConfig",
    "StrategyConfig",
    "applied",
    "apply",
    "describe_strategies",
    "register_strategy",
    "resolve",
    "revert",
    "strategy_names",
]

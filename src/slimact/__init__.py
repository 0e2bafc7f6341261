"""slimact: cut the activation memory of transformer training.

Every tensor autograd saves for backward is a *site*; a *plan* gives each site an *action*
(keep, recompute, store through a codec, or reformulate the op). See ARCHITECTURE.md.
"""

from slimact.meter import MemoryReport, measure, measure_step
from slimact.models import build_model, count_params, model_names
from slimact.strategies import (
    StrategyConfig,
    applied,
    apply,
    register_strategy,
    revert,
    strategy_names,
)
from slimact.strategies.compiled_presets import compiled_plan_of
from slimact.strategies.presets import plan_of

__version__ = "0.1.0"
__all__ = [
    "MemoryReport",
    "StrategyConfig",
    "__version__",
    "applied",
    "apply",
    "build_model",
    "compiled_plan_of",
    "count_params",
    "measure",
    "measure_step",
    "model_names",
    "plan_of",
    "register_strategy",
    "revert",
    "strategy_names",
]

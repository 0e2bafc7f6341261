"""Per-model state: everything slimact keeps on one model, in one typed object.

``state_of(model)`` is the model's ``ModelState``, created on first use and stored in the
model's ``__dict__`` under the one key ``"_slimact"`` (not as an attribute, so ``nn.Module``
does not treat it as a submodule and ``state_dict`` never sees it). Living in ``__dict__``,
it travels with the model: ``copy.deepcopy`` copies it with the model (the copy's runtime, codec
states and change log refer to the copy, through deepcopy's memo), and ``pickle`` /
``torch.save`` carry it (what cannot be copied refuses in one line: ``patching.NotCopyable``).

Fields: the change log of ``slimact.apply`` (``applied``) and the names of the strategies
applied (``strategies``); the plan runtime (``runtime``) and its first-step budget check
(``budget_check``); strategy state that checkpoints must carry (``stateful``: name -> object
with ``state_dict``/``load_state_dict``, e.g. PRAC's subspaces); the plan ``compiled-auto``
solved (``compiled_plan``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch.nn as nn

_KEY = "_slimact"


@dataclass
class ModelState:
    applied: list[Any] = field(default_factory=list)  # AppliedChange, in order
    strategies: list[str] = field(default_factory=list)
    runtime: Any = None  # slimact.planner.apply.PlanRuntime
    budget_check: Any = None  # slimact.planner.adaptive.BudgetCheck
    stateful: dict[str, Any] = field(default_factory=dict)
    compiled_plan: Any = None  # slimact.planner.compiled.CompiledPlan (compiled-auto)


def state_of(model: nn.Module) -> ModelState:
    """The model's state, created on first use."""
    st = model.__dict__.get(_KEY)
    if st is None:
        st = model.__dict__[_KEY] = ModelState()
    return st


def peek(model: nn.Module) -> ModelState | None:
    """The model's state if slimact ever touched it, else None (nothing is created)."""
    return model.__dict__.get(_KEY)


def _default(f: Any) -> Any:
    return f.default_factory() if callable(f.default_factory) else f.default


def prune(model: nn.Module) -> None:
    """Drop the state once every field is back at its default: a reverted model (or one whose
    failed ``apply`` was undone) carries nothing of slimact's."""
    st = peek(model)
    if st is not None and all(getattr(st, f.name) == _default(f) for f in fields(ModelState)):
        del model.__dict__[_KEY]


def reset_field(model: nn.Module, name: str) -> None:
    """Set field ``name`` back to its default (a picklable undo step)."""
    st = peek(model)
    if st is None:
        return
    f = next(f for f in fields(ModelState) if f.name == name)
    setattr(st, name, _default(f))
    prune(model)


def drop_stateful(model: nn.Module, name: str) -> None:
    """Forget strategy state ``name`` (a picklable undo step)."""
    st = peek(model)
    if st is not None:
        st.stateful.pop(name, None)
        prune(model)

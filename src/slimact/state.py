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

Wrappers are seen through (:func:`model_of`): the state of a ``PeftModel``, a DDP /
``DataParallel`` wrapper or any other ``.module`` wrapper is the state of the model it wraps, so
``slimact.apply``, ``applied`` and ``revert`` reach the same model whether they are given the
wrapper or the model, before or after it was wrapped.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch.nn as nn

_KEY = "_slimact"
_KINDS: dict[type, str] = {}  # class -> "peft" | "tuner" | "" (what kind of wrapper it is)


def _wrapper_kind(cls: type) -> str:
    kind = _KINDS.get(cls)
    if kind is None:  # by class name: peft is an optional dependency
        names = {c.__name__ for c in cls.__mro__}
        kind = _KINDS[cls] = (
            "peft" if "PeftModel" in names else "tuner" if "BaseTuner" in names else ""
        )
    return kind


def wrapped(model: nn.Module) -> nn.Module | None:
    """The model ``model`` wraps (one level), or None where it is no wrapper: a peft
    ``PeftModel`` (its ``get_base_model()``; not a prompt-learning one, whose forward runs its
    prompt encoder and prepends virtual tokens: that ``PeftModel`` is the model), a peft tuner
    (``LoraModel``: its ``model``), and a ``.module`` wrapper (``DistributedDataParallel``,
    ``DataParallel``, an accelerate-prepared model under DDP, any module with no parameters or
    buffers of its own whose one child is ``module``). A model compiled whole
    (``torch.compile``) is not seen through: it is refused where it matters
    (``registry.refuse_compiled_root``)."""
    kind = _wrapper_kind(type(model))
    if kind == "peft":
        if getattr(getattr(model, "active_peft_config", None), "is_prompt_learning", False):
            return None  # its forward prepends virtual tokens: acted on as the model it is
        inner = model.get_base_model()
    elif kind == "tuner":
        inner = model.__dict__["_modules"].get("model")
    else:
        d = model.__dict__
        mods = d.get("_modules") or {}
        if len(mods) != 1 or "module" not in mods or d.get("_parameters") or d.get("_buffers"):
            return None
        inner = mods["module"]
    return inner if isinstance(inner, nn.Module) and inner is not model else None


def model_of(model: nn.Module) -> nn.Module:
    """The model slimact acts on for ``model``: ``model`` with every wrapper (:func:`wrapped`)
    peeled off, e.g. the ``LlamaForCausalLM`` inside a LoRA ``PeftModel`` inside DDP. The
    wrapped model holds the LoRA layers (peft injects them in place), so acting on it acts on
    what the wrapper's forward runs. ``slimact.hf_inputs.hf_model_of`` is this function."""
    for _ in range(16):  # wrappers nest a few levels deep at most; no cycle can loop forever
        inner = wrapped(model)
        if inner is None:
            return model
        model = inner
    return model


@dataclass
class ModelState:
    applied: list[Any] = field(default_factory=list)  # AppliedChange, in order
    strategies: list[str] = field(default_factory=list)
    runtime: Any = None  # slimact.planner.apply.PlanRuntime
    budget_check: Any = None  # slimact.planner.adaptive.BudgetCheck
    stateful: dict[str, Any] = field(default_factory=dict)
    compiled_plan: Any = None  # slimact.planner.compiled.CompiledPlan (compiled-auto)


def state_of(model: nn.Module) -> ModelState:
    """The model's state (the wrapped model's, :func:`model_of`), created on first use."""
    model = model_of(model)
    st = model.__dict__.get(_KEY)
    if st is None:
        st = model.__dict__[_KEY] = ModelState()
    return st


def peek(model: nn.Module) -> ModelState | None:
    """The model's state (the wrapped model's, :func:`model_of`) if slimact ever touched it,
    else None (nothing is created)."""
    return model_of(model).__dict__.get(_KEY)


def _default(f: Any) -> Any:
    return f.default_factory() if callable(f.default_factory) else f.default


def prune(model: nn.Module) -> None:
    """Drop the state once every field is back at its default: a reverted model (or one whose
    failed ``apply`` was undone) carries nothing of slimact's."""
    st = peek(model)
    if st is not None and all(getattr(st, f.name) == _default(f) for f in fields(ModelState)):
        del model_of(model).__dict__[_KEY]


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

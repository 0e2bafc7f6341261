"""Instance patches that survive ``copy.deepcopy``, ``pickle`` and ``torch.save``.

Strategies change a module on the instance (its ``forward``, a few ``_slimact_*`` attributes) so
module paths and the state_dict stay as they are. A patch written as a closure or a bound method
breaks copies: ``copy.deepcopy`` copies functions by reference, so a copy's forward would still
run the *original* module (its weights, its codec state) and training the copy would change
nothing in it; ``pickle`` cannot store local functions at all; and a bound method of the patched
``forward`` pickles as ``getattr(module, "forward")``, which after loading is the patch itself
(infinite recursion).

So every instance patch here is plain data over module-level functions:

- :class:`ForwardOverride` holds the module, the instance-level forward it replaced (or None: the
  class's ``forward``), a module-level ``wrapper`` and its extra arguments. Calling it runs
  ``wrapper(inner, *args, *call_args, **call_kwargs)`` with ``inner`` the replaced forward, bound
  at call time. ``deepcopy``'s memo maps the module to the copy's, and pickle stores it by
  reference, so a copy patches the copy.
- Undo callables are ``functools.partial`` of module-level functions with the module as an
  argument (:func:`undo_forward`, :func:`pop_attr`, :func:`run_all`): deep-copied and pickled with
  the model, they undo the copy's patches.
- :class:`NotCopyable` wraps what genuinely cannot be copied (a ``torch.compile``'d function): it
  calls through, and ``deepcopy``/``pickle`` raise one ``TypeError`` saying what and what to do.

Nothing here imports from slimact: strategies, codecs and the planner all build on it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch.nn as nn


class ForwardOverride:
    """``module.forward`` replaced by ``wrapper(inner, *args, *call_args, **call_kwargs)``.

    ``inner`` is the forward this override replaced: the previous instance-level override, or the
    class's ``forward`` bound to ``module`` at call time (never stored: see the module docstring).
    """

    __slots__ = ("module", "prev", "wrapper", "args")

    def __init__(self, module: nn.Module, wrapper: Callable[..., Any], *args: Any) -> None:
        self.module = module
        self.prev = module.__dict__.get("forward")
        self.wrapper = wrapper
        self.args = args

    def inner(self) -> Callable[..., Any]:
        if self.prev is not None:
            return self.prev
        return functools.partial(type(self.module).forward, self.module)  # dynamo traces this

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.wrapper(self.inner(), *self.args, *args, **kwargs)

    @property
    def __wrapped__(self) -> Callable[..., Any]:
        """The replaced forward: ``inspect.signature`` (HF Trainer's column check) follows it."""
        return self.inner()

    def __repr__(self) -> str:
        name = getattr(self.wrapper, "__qualname__", repr(self.wrapper))
        return f"<forward of {type(self.module).__name__} through {name}>"


def override_forward(
    module: nn.Module, wrapper: Callable[..., Any], *args: Any
) -> tuple[ForwardOverride, Callable[[], None]]:
    """Install ``ForwardOverride(module, wrapper, *args)``; returns it and its (picklable) undo."""
    override = ForwardOverride(module, wrapper, *args)
    module.__dict__["forward"] = override
    return override, functools.partial(undo_forward, module, override)


def overrides(module: nn.Module) -> list[ForwardOverride]:
    """The chain of slimact forward overrides on ``module``, outermost first."""
    out = []
    f = module.__dict__.get("forward")
    while isinstance(f, ForwardOverride):
        out.append(f)
        f = f.prev
    return out


def undo_forward(module: nn.Module, override: ForwardOverride) -> None:
    """Take ``override`` out of ``module``'s forward chain (wherever it sits in it)."""
    current = module.__dict__.get("forward")
    if current is override:
        if override.prev is None:
            module.__dict__.pop("forward", None)
        else:
            module.__dict__["forward"] = override.prev
        return
    while isinstance(current, ForwardOverride):  # a later override wraps this one: unlink it
        if current.prev is override:
            current.prev = override.prev
            return
        current = current.prev


def pop_attr(module: nn.Module, key: str, subkey: str | None = None) -> None:
    """Drop ``module.__dict__[key]`` (or only ``[key][subkey]`` of a dict kept there)."""
    if subkey is None:
        module.__dict__.pop(key, None)
    else:
        module.__dict__.get(key, {}).pop(subkey, None)


def run_all(*fns: Callable[[], None]) -> None:
    """Call each of ``fns`` in order (compose undo steps into one picklable callable)."""
    for fn in fns:
        fn()


class NotCopyable:
    """Calls ``fn``; ``copy.deepcopy``/``pickle`` raise one clear ``TypeError`` naming ``what``."""

    __slots__ = ("fn", "what")

    def __init__(self, fn: Callable[..., Any], what: str) -> None:
        self.fn = fn
        self.what = what

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def _refuse(self, *_: Any) -> Any:
        raise TypeError(
            f"slimact: cannot copy or pickle a model carrying {self.what}; call "
            "slimact.revert(model) first, or save model.state_dict() and re-apply the strategy"
        )

    __deepcopy__ = _refuse
    __reduce_ex__ = _refuse
    __reduce__ = _refuse

"""KV caches and activation checkpointing: what the ``recompute`` strategy and the plan runtime
share so that Hugging Face decoders train correctly with their blocks recomputed.

A checkpointed block that writes a KV cache writes it a second time when backward replays it:
the returned cache doubles, and at one token the replay's keys differ in shape from the first
run's and backward raises ``CheckpointError``. Hugging Face's own gradient checkpointing avoids
that by running training forwards without a cache; so does slimact:

* :func:`guard_cache` puts a forward pre-hook on the model, where its forward takes
  ``use_cache``, and on every Hugging Face model inside it whose forward does (the decoder
  ``LlamaModel`` inside ``LlamaForCausalLM``, where HF's own gradient checkpointing drops the
  cache): in a training forward (training mode, grad enabled) ``use_cache`` becomes False, with
  one warning per model when the caller or the model's ``config.use_cache`` asked for a cache
  (an inner model's config alone does not warn: BERT's encoder takes ``use_cache``; the wording
  follows HF's "`use_cache=True` is incompatible with gradient checkpointing. Setting
  `use_cache=False`"). The inner hooks are what reach a model run through a wrapper whose
  forward takes no ``use_cache`` (peft's ``PeftModelForCausalLM``) or that calls the model's
  ``forward`` without its hooks. Reverting removes them all: the cache is back in training.
* :func:`carries_cache` tells a checkpointed block that it was handed a cache anyway (a cache
  passed in explicitly, or an eval-mode forward with grad on); the block then runs without
  checkpointing, so the cache is written once and the gradients stay exact. It warns once per
  block class and reason.

* :func:`checkpointed` is *the* checkpoint wrapper (``override_forward(module, checkpointed,
  preserve_rng_state)``), used by ``recompute``, the plan runtime and the benchmark's
  ``torch-checkpoint`` anchor: non-reentrant ``torch.utils.checkpoint``, with the inputs the
  checkpoint keeps named ``<module>:checkpoint_input#k`` (``sites.role``; they are saved through
  autograd, so the router sees them, a codec policy may encode them and the meter counts them).

Without grad (eval, ``generate``) neither acts: caches are built and returned as without slimact.
Layer 3 (see ARCHITECTURE.md): it needs only ``registry`` below it, and both the strategies and
``planner.apply`` (layer 4) use it.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from slimact import sites
from slimact.hf_inputs import is_hf_model
from slimact.patching import override_forward, overrides, run_all
from slimact.registry import AppliedChange

# keyword names HF layers receive their KV cache (or a legacy per-layer past) under
CACHE_KWARGS = ("past_key_values", "past_key_value", "cache", "layer_past", "cache_params")
GUARD_ACTION = "no-cache-in-training"


def is_cache(value: Any) -> bool:
    """A transformers ``Cache`` (any subclass), checked without importing transformers."""
    return any(c.__name__ == "Cache" for c in type(value).__mro__)


def _owner_name(orig: Any) -> str:
    owner = getattr(orig, "module", None)  # a ForwardOverride below the checkpointing one
    if owner is None and isinstance(orig, functools.partial) and orig.args:
        owner = orig.args[0]  # the class forward bound to the module
    return type(owner).__name__ if isinstance(owner, nn.Module) else "a block"


def carries_cache(orig: Any, args: tuple, kwargs: dict) -> bool:
    """True (and one warning per block class) when a block call is handed a KV cache it may
    write; ``orig`` is the block's forward, for the warning's wording."""
    found = any(is_cache(a) for a in args) or any(
        v is not None and (k in CACHE_KWARGS or is_cache(v)) for k, v in kwargs.items()
    )
    if found:
        warnings.warn(
            f"slimact: {_owner_name(orig)} got a KV cache in a grad-enabled forward; it runs "
            "without recomputation (a replay would write the cache twice)",
            UserWarning,
            stacklevel=3,
        )
    return found


class CacheGuard:
    """State of one model's ``use_cache`` guard, shared by its hooks: what recomputes (for the
    warning) and whether it warned."""

    def __init__(self, who: str) -> None:
        self.who = who
        self.warned = False


def checkpointed(orig: Any, preserve_rng_state: bool, *args: Any, **kwargs: Any) -> Any:
    """Run ``orig(*args, **kwargs)`` under non-reentrant checkpointing (the wrapper slimact puts on
    every recomputed module: ``override_forward(module, checkpointed, preserve_rng_state)``); as
    is without grad, when handed a KV cache (see above), and inside a strategy's probe
    (``sites.probing()``: a probe asks what the ops save, as a plan's reformulations are found on
    the model without its recomputation, whatever was applied first)."""
    if not isinstance(preserve_rng_state, bool):
        raise TypeError(f"preserve_rng_state must be a bool, got {type(preserve_rng_state)}")
    if (
        not torch.is_grad_enabled()
        or sites.is_probing()
        or carries_cache(orig, args, kwargs)  # written twice on replay
    ):
        return orig(*args, **kwargs)
    with sites.role("checkpoint_input"):
        return checkpoint(
            orig, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state, **kwargs
        )


def checkpoint_module(module: nn.Module, preserve_rng_state: bool = True) -> Callable[[], None]:
    """Patch ``module``'s forward (on the instance) to run under :func:`checkpointed`; returns
    the undo. The one place a module is made to recompute (the plan runtime's patchers call it)."""
    _, undo = override_forward(module, checkpointed, preserve_rng_state)
    return undo


def checkpointed_modules(module: nn.Module) -> list[str]:
    """The modules in ``module`` (itself: ``""``) that run under :func:`checkpointed`."""
    return [
        path
        for path, m in module.named_modules()
        if any(o.wrapper is checkpointed for o in overrides(m))
    ]


def use_cache_position(model: nn.Module) -> int | None | bool:
    """Index of ``use_cache`` in ``type(model).forward`` (self excluded; None: keyword-only);
    False where the forward takes no ``use_cache``."""
    try:
        params = list(inspect.signature(type(model).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    for i, p in enumerate(params):
        if p.name == "use_cache":
            return i if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) else None
    return False


def _cache_guard_hook(
    guard: CacheGuard, pos: int | None, root: bool, module: nn.Module, args: tuple, kwargs: dict
):
    """``pos``: the positional index of ``use_cache`` in ``module``'s forward (None:
    keyword-only). ``root``: the hook of the model the guard was put on, which warns when its
    config asks for a cache; an inner model's hook warns only when its caller asked (BERT's
    ``BertModel`` takes ``use_cache`` for decoder use: under ``BertForMaskedLM`` nobody did)."""
    if not (module.training and torch.is_grad_enabled()):
        return None
    if pos is not None and len(args) > pos:
        asked = args[pos]
        args = (*args[:pos], False, *args[pos + 1 :])
    else:
        asked = kwargs.get("use_cache")
        kwargs = {**kwargs, "use_cache": False}
    if asked is None and root:
        asked = getattr(getattr(module, "config", None), "use_cache", False)
    if asked and not guard.warned:
        guard.warned = True
        warnings.warn(
            f"{type(module).__name__}: `use_cache=True` is incompatible with {guard.who} in "
            "training; setting `use_cache=False` (training forwards return no KV cache, as "
            "with Hugging Face gradient checkpointing)",
            UserWarning,
            stacklevel=5,  # the caller of model(...)
        )
    return args, kwargs


def _drop_pre_hook(model: nn.Module, hook_id: int) -> None:
    model._forward_pre_hooks.pop(hook_id, None)
    model._forward_pre_hooks_with_kwargs.pop(hook_id, None)


def _guards(module: nn.Module) -> bool:
    return any(
        isinstance(h, functools.partial) and h.func is _cache_guard_hook
        for h in module._forward_pre_hooks.values()
    )


def has_cache_guard(model: nn.Module) -> bool:
    """Does ``model`` or a module inside it carry a ``use_cache`` guard?"""
    return any(_guards(m) for m in model.modules())


def guard_cache(model: nn.Module, who: str = "activation recomputation") -> AppliedChange | None:
    """Run ``model``'s training forwards (training mode, grad on) with ``use_cache=False``.

    Hooks the model, where its forward takes ``use_cache`` (Hugging Face LMs and seq2seq models),
    and every Hugging Face model inside it whose forward does (the decoder a wrapper's forward
    reaches however it is called); warns once per model when a cache was asked for, explicitly
    or by the model's ``config.use_cache``. Returns the undoable change (picklable: partials of module-level
    functions), or None where no forward takes ``use_cache`` or a guard is already installed.
    """
    if has_cache_guard(model):
        return None
    targets = [
        (m, pos)
        for m in model.modules()
        if (m is model or is_hf_model(m)) and (pos := use_cache_position(m)) is not False
    ]
    if not targets:
        return None
    guard = CacheGuard(who)
    undos = []
    for m, pos in targets:
        handle = m.register_forward_pre_hook(
            functools.partial(_cache_guard_hook, guard, pos, m is model),
            with_kwargs=True,
            prepend=True,
        )
        undos.append(functools.partial(_drop_pre_hook, m, handle.id))
    undo = functools.partial(run_all, *undos)
    return AppliedChange("", GUARD_ACTION, "use_cache=False in training forwards", undo=undo)


__all__ = [
    "CACHE_KWARGS",
    "carries_cache",
    "checkpoint_module",
    "guard_cache",
    "has_cache_guard",
    "is_cache",
]

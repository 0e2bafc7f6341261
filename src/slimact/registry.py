"""Strategy registry: a name or a typed config maps to a preset (its plan) or a transform.

torchao-style: each strategy is a frozen dataclass config; ``register_strategy`` ties a name and a
config class to its *preset*, ``preset(model, config, filter_fn) -> (Plan, rows)``, which one
installer puts on the plan runtime (``register_part_install``), or to a
``transform(model, config, filter_fn) -> AppliedChange list`` of its own. ``apply`` accepts
``"name"``, a config, ``"name@settings"`` (``"auto@25%"``, read by ``slimact.spec``, the one
grammar, into the config's ``spec_fields``), or ``"a+b"`` to compose several (applied left to right; a spec of presets alone is one merged
plan, ``register_preset_path``). Every change is
recorded on the model (``applied(model)``) and can be undone with ``revert(model)``. A wrapper
(a peft ``PeftModel``, DDP, any ``.module`` wrapper) is seen through: all three act on the model
it wraps (``state.model_of``), so apply before or after wrapping and revert through either.

``apply`` is all-or-nothing: if any part of a composition raises, the parts already applied are
undone newest first and the original error propagates; the model is left as it was.

Composition is ``Plan.merge`` alone: the parts of a spec, and a later ``apply`` on a model that
carries a plan, are merged into one plan, which refuses what cannot hold together, naming the
sites or modules (two codec rules on the same modules, a codec inside a recomputed module, ...);
the plan runtime refuses to recompute a block compiled by slimact and a second compiler refuses
a checkpointed block. Rules for disjoint modules merge: ``apply(m, "int4", in_block0)`` then
``apply(m, "int8", in_block1)`` codes each block by its own rule. A part that changes nothing
again (``recompute`` on blocks it already checkpoints) is reported as skipped.
A model compiled whole by the user (``torch.compile(model)``) is refused: ``compile=True``.
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import dataclasses
import functools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn

from slimact import spec
from slimact.spec import COMPILED_PREFIX
from slimact.state import model_of, peek, prune, state_of

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
# a strategy as a plan: (model, config, filter_fn) -> (the Plan, the rows the strategy reports)
Preset = Callable[[nn.Module, StrategyConfig, FilterFn | None], tuple[Any, list[AppliedChange]]]


@dataclass(frozen=True)
class _Entry:
    config_cls: type
    default: StrategyConfig
    transform: Transform | None  # None: a preset's, installed by the one part installer
    description: str
    codec_policy: bool = False  # its transform installs a codec policy (its plan decides codecs)
    compiled_form: str | None = None  # what ``apply(..., compile=True)`` applies instead
    compile_safe: bool = False  # applied as it is under ``compile=True`` (its ops compile)
    compile_args: str = ""  # ``key=value,...`` its spec takes under ``compile=True`` (unless given)
    preset: Preset | None = None  # the strategy as a plan


_REGISTRY: dict[str, _Entry] = {}

# (model, configs, filter_fn) -> the changes of the whole spec, or None where the spec is not one
# of presets (``strategies/presets.py`` registers it; this layer cannot import the strategies)
PresetPath = Callable[
    [nn.Module, list[StrategyConfig], FilterFn | None], list[AppliedChange] | None
]
_PRESET_PATH: list[PresetPath] = []


def register_preset_path(fn: PresetPath) -> None:
    """Let ``apply`` try ``fn`` first for a whole spec: it applies every part at once (one merged
    plan on the plan runtime, or one compiled plan) and returns the changes, or returns None and
    changes nothing, and ``apply`` tries the next path, then applies the parts one after another
    (``transform_of``). Paths are tried in the order registered, each once."""
    key = _qualname(fn)
    _PRESET_PATH[:] = [f for f in _PRESET_PATH if _qualname(f) != key] + [fn]


_PART_BY_PART = contextvars.ContextVar("slimact_part_by_part", default=False)


def part_by_part() -> bool:
    """Is ``apply`` applying a spec part by part (one not all presets: the preset path declined
    it)? A preset's transform then leaves the one runtime to the planner part of the spec or of
    the model (``strategies/parts.py``)."""
    return _PART_BY_PART.get()


@contextlib.contextmanager
def parts_one_by_one() -> Iterator[None]:
    """Run strategies' transforms as ``apply``'s part-by-part path runs them
    (:func:`part_by_part` is true inside)."""
    token = _PART_BY_PART.set(True)
    try:
        yield
    finally:
        _PART_BY_PART.reset(token)


# exact type -> its config: objects ``apply`` takes that are not configs themselves (a solved
# ``CompiledPlan`` is a mutable record, so not a frozen ``StrategyConfig``)
_CONFIG_TYPES: dict[type, Callable[[Any], StrategyConfig]] = {}


def register_config_type(cls: type, to_config: Callable[[Any], StrategyConfig]) -> None:
    """Let ``apply`` (and ``resolve``) take an object of type ``cls`` as a strategy:
    ``to_config`` turns it into the config of a registered strategy, whose transform applies it
    (``slimact.planner.compiled.CompiledPlan`` -> the ``compiled-plan`` strategy's config)."""
    _CONFIG_TYPES[cls] = to_config


def as_config(strategy: object) -> object:
    """``strategy`` as ``apply`` reads it: an object of a registered config type
    (:func:`register_config_type`) as its config, anything else as it is."""
    to_config = _CONFIG_TYPES.get(type(strategy))
    return to_config(strategy) if to_config is not None else strategy


def register_strategy(
    name: str,
    default: StrategyConfig,
    transform: Transform | None = None,
    description: str = "",
    codec_policy: bool = False,
    *,
    preset: Preset | None = None,
    compiled_form: str | None = None,
    compile_safe: bool = False,
    compile_args: str = "",
) -> None:
    """Register ``name`` with its ``preset`` (the strategy as a plan, installed by the one part
    installer) or a ``transform`` of its own, one of the two. Registering the same name again
    from the same function (a module that is imported a second time, e.g. after an earlier
    import of the package failed half-way) replaces the entry; another under a taken name is an
    error.

    What the strategy is, said by itself: ``codec_policy``, its transform installs a codec
    policy (its plan decides codecs); ``compiled_form``, the strategy
    ``apply(..., compile=True)`` applies in its place (``"compiled-int8"``); ``compile_safe``,
    it is applied as it is under ``compile=True``, with ``compile_args`` (``"ops=none"``: each
    ``key=value`` its spec does not set) added to its spec there."""
    if (transform is None) == (preset is None):
        raise ValueError(f"strategy {name!r} takes a preset or a transform (one of the two)")
    fn = transform or preset
    old = _REGISTRY.get(name)
    if old is not None and _qualname(old.transform or old.preset) != _qualname(fn):
        raise ValueError(
            f"strategy {name!r} is already registered by {_qualname(old.transform or old.preset)}"
            f"; cannot register it again for {_qualname(fn)}"
        )
    _REGISTRY[name] = _Entry(
        type(default), default, transform, description, codec_policy, compiled_form,
        compile_safe, compile_args, preset,
    )  # fmt: skip


# (model, plan, rows) -> changes: the one installer of a preset's part (``strategies/parts.py``)
_PART_INSTALL: list[Callable[[nn.Module, Any, list[AppliedChange]], list[AppliedChange]]] = []


def register_part_install(
    fn: Callable[[nn.Module, Any, list[AppliedChange]], list[AppliedChange]],
) -> None:
    """Let ``fn(model, plan, rows)`` install one preset part (a spec applied part by part)."""
    _PART_INSTALL[:] = [fn]


def _install_preset(
    preset: Preset, model: nn.Module, config: StrategyConfig, filter_fn: FilterFn | None
) -> list[AppliedChange]:
    plan, rows = preset(model, config, filter_fn)
    return _PART_INSTALL[0](model, plan, rows)


_RENAMED: dict[str, str] = {}  # an earlier strategy name -> its registered name


def register_rename(old: str, new: str) -> None:
    """Let a spec name strategy ``new`` by its earlier name ``old`` (``old@...`` too), so saved
    specs and plans keep working; ``strategy_names`` lists only ``new``."""
    if old in _REGISTRY:
        raise ValueError(f"cannot rename {old!r} to {new!r}: {old!r} is a registered strategy")
    _RENAMED[old] = new


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


def codec_policy_names() -> frozenset[str]:
    """The registered strategies whose transform installs a codec policy."""
    return frozenset(n for n, e in _REGISTRY.items() if e.codec_policy)


def compiled_form_of(name: str) -> str | None:
    """The strategy ``apply(..., compile=True)`` applies for strategy ``name``, if it has one."""
    entry = _REGISTRY.get(name)
    return entry.compiled_form if entry is not None else None


def compile_safe(config: StrategyConfig) -> bool:
    """Is ``config``'s strategy applied as it is under ``compile=True`` (its ops compile)?"""
    return _entry_for(config).compile_safe


def transform_of(config: StrategyConfig) -> Transform:
    """What ``apply`` runs for one part ``config``: its preset installed by the one part
    installer, or its strategy's own transform."""
    entry = _entry_for(config)
    return entry.transform or functools.partial(_install_preset, entry.preset)


def preset_of(config: StrategyConfig) -> Preset | None:
    """``config``'s strategy as a plan (None: a strategy with a transform of its own)."""
    return _entry_for(config).preset


def resolve(strategy: str | StrategyConfig) -> list[StrategyConfig]:
    """``"none"``, ``"invact+int4"`` or a config -> list of configs (how they compose is their
    plans' to say, at ``apply``: ``Plan.merge``)."""
    return [cfg for _, cfg in _resolve_named(strategy)]


def _part(part: spec.Part) -> spec.Part:
    """``part`` under its strategy's registered name (an earlier name read as today's)."""
    return dataclasses.replace(part, name=_RENAMED[part.name]) if part.name in _RENAMED else part


def _config_of(part: spec.Part, whole: str) -> StrategyConfig:
    entry = _REGISTRY.get(part.name)
    if entry is None:
        raise ValueError(
            f"unknown strategy {str(part)!r}; valid strategies: {', '.join(_REGISTRY)}"
        )
    return spec.configure(entry.default, part)


def parse(strategy: str) -> list[spec.Part]:
    """``strategy``'s parts (``slimact.spec``), each under its registered name."""
    return [_part(p) for p in spec.parse(strategy, _REGISTRY)]


def _resolve_named(strategy: str | StrategyConfig) -> list[tuple[str, StrategyConfig]]:
    """Like ``resolve``, with each config's label (its part of the spec, or its name)."""
    strategy = as_config(strategy)
    if isinstance(strategy, StrategyConfig):
        return [(strategy.name, strategy)]
    if not isinstance(strategy, str) or not strategy.strip():
        raise ValueError(
            f"strategy must be a name or a StrategyConfig, got {strategy!r}; "
            f"valid names: {', '.join(_REGISTRY)}"
        )
    return [(str(p), _config_of(p, strategy)) for p in parse(strategy)]


def compiled_spec(strategy: str) -> str:
    """The spec ``apply(..., compile=True)`` applies for ``strategy``: each part by its compiled
    form (``register_strategy(compiled_form=...)``; block strategies become the one ``compiled-*``
    strategy that compiles every block with its actions inside), the parts whose ops compile as
    they are (``compile_safe``) first, then the blocks are compiled:
    ``"auto@25%"`` -> ``"compiled-auto@25%"``, ``"invact+int4"`` ->
    ``"invact@ops=none+compiled-int4"`` (under compile, norms only), ``"int8+recompute"`` ->
    ``"compiled-int8@0"`` (the codec under region budget 0), ``"invact"`` ->
    ``"invact@ops=none+compiled-none"``. A part with no compiled form is a ``ValueError``."""
    if not isinstance(strategy, str) or not strategy.strip():
        raise ValueError(f"compile=True needs a strategy name or spec, got {strategy!r}")
    eager: list[spec.Part] = []
    blocks: list[spec.Part] = []
    for part in parse(strategy):
        e = _REGISTRY.get(part.name)
        if part.name.startswith(COMPILED_PREFIX):
            blocks.append(part)
        elif e is not None and e.compiled_form is not None:
            blocks.append(dataclasses.replace(part, name=e.compiled_form))
        elif e is not None and e.compile_safe:
            args = (
                spec.parse_part(f"{part.name}{spec.AT}{e.compile_args}") if e.compile_args else None
            )
            eager.append(part.with_settings(**dict(args.settings)) if args else part)
        else:
            forms = [n for n, e in _REGISTRY.items() if e.compiled_form]
            safe = sorted(n for n, e in _REGISTRY.items() if e.compile_safe)
            raise ValueError(
                f"strategy {str(part)!r} has no compiled form (compile=True); strategies that "
                f"do: {', '.join([*forms, *safe])}, and the compiled-* ones"
            )
    if len(blocks) == 2 and "compiled-recompute" in (names := [str(b) for b in blocks]):
        other = blocks[1 - names.index("compiled-recompute")]
        e = _REGISTRY.get(str(other))  # its config says whether its codec runs at region budget 0
        if e is not None and getattr(e.default, "merges_with_recompute", False):
            blocks = [other.with_settings(region="0")]
    if len(blocks) > 1:
        raise ValueError(
            f"strategy {strategy!r} under compile=True gives each block {len(blocks)} compiled "
            f"forms ({', '.join(map(str, blocks))}); a block is compiled once: keep one of them "
            "(a codec and recompute merge: 'int8+recompute' is compiled-int8 at region budget 0)"
        )
    return spec.join([*eager, *(blocks or ["compiled-none"])])


_GRAPH_FORM: list[Callable[..., str | None]] = []  # the one-graph rule (``planner/graph.py``)
register_graph_form = _GRAPH_FORM.append


def compile_form(strategy: str, model: nn.Module | None = None) -> str:
    """The spec ``compile=True`` applies to ``model``: the one-graph form where the registered
    rule gives one (``"recompute"`` -> ``"recompute+graph"``), else :func:`compiled_spec`'s."""
    graph = _GRAPH_FORM[-1](strategy, model) if _GRAPH_FORM else None
    return graph if graph is not None else compiled_spec(strategy)


def add_compile_argument(parser: argparse.ArgumentParser) -> None:
    """The ``--compile`` flag of the command lines (``apply(..., compile=True)``)."""
    parser.add_argument(
        "--compile",
        action="store_true",
        help="none, invact and chunked-ce: the root forward and loss as one compiled graph; "
        "otherwise every block compiled with the strategy's actions inside (root eager): auto "
        "becomes compiled-auto, int8/int4 traced codecs, recompute compile's partitioner at "
        "region budget 0",
    )


def cli_spec(strategy: str, budget: object = None, compile: bool = False) -> str:
    """The spec a command line applies: ``--budget`` into ``auto``, then ``--compile``."""
    spec = with_budget(strategy, None if budget is None else str(budget))
    return compile_form(spec) if compile else spec


def with_budget(strategy: str, budget: str | None) -> str:
    """``("auto", "25%") -> "auto@25%"``: the ``--budget`` flag of the CLIs, for every ``auto``."""
    if budget is None:
        return strategy
    parts = parse(strategy)
    if not any(str(p) == "auto" for p in parts):
        raise ValueError(f"--budget {budget} applies to strategy 'auto', not to {strategy!r}")
    given = spec.parse_budget(budget)
    return spec.join(dataclasses.replace(p, budget=given) if str(p) == "auto" else p for p in parts)


def _entry_for(config: StrategyConfig) -> _Entry:
    for entry in _REGISTRY.values():
        if type(config) is entry.config_cls:
            return entry
    raise ValueError(f"no strategy is registered for config type {type(config).__name__}")


def apply(
    model: nn.Module,
    strategy: str | StrategyConfig,
    filter_fn: FilterFn | None = None,
    *,
    compile: bool = False,
) -> nn.Module:
    """Apply a strategy to ``model`` in place and return it; the changes are logged and recorded.

    ``filter_fn(module, path) -> bool`` restricts which modules a transform may touch. All or
    nothing: when a part raises, the parts already applied are undone (newest first) and the
    error propagates, so the model is as it was before the call.

    ``compile=True`` compiles every block with the strategy's actions inside it (the root stays
    eager): the spec is rewritten by :func:`compiled_spec` (``"auto@25%"`` becomes the compiled
    planner ``"compiled-auto@25%"``); a config must already be a ``compiled-*`` one (a solved
    ``CompiledPlan`` is: ``register_config_type``).

    A model the user compiled whole (``torch.compile(model)``, an ``OptimizedModule``) is
    refused: its forward is one compiled graph that slimact's hooks cannot enter, so a strategy
    on it would do nothing; ``compile=True`` on the plain model compiles its blocks with the
    strategy inside them.

    A wrapper (``PeftModel``, DDP, a ``.module`` wrapper) is seen through: the strategy acts on
    the model it wraps (``state.model_of``), which holds the LoRA layers and runs under the
    wrapper's forward; the wrapper is returned.
    """
    wrapper, model = model, model_of(model)
    refuse_compiled_root(model, "slimact.apply")
    strategy = as_config(strategy)
    if compile:
        if isinstance(strategy, StrategyConfig):
            if not strategy.name.startswith(COMPILED_PREFIX):
                raise ValueError(
                    f"compile=True takes a strategy name or spec (e.g. 'auto@25%') or a "
                    f"compiled-* config, not {type(strategy).__name__}"
                )
        else:
            strategy = compile_form(strategy, model)
    parts = _resolve_named(strategy)
    done: list[AppliedChange] = []
    try:
        preset = None
        for path in _PRESET_PATH:
            preset = path(model, [c for _, c in parts], filter_fn)
            if preset is not None:
                break
        if preset is not None:
            done.extend(preset)
            logger.info("slimact.apply %s: one preset plan, %d change(s)", strategy, len(preset))
        for _, cfg in parts if preset is None else ():
            with parts_one_by_one():
                changes = transform_of(cfg)(model, cfg, filter_fn)
            done.extend(changes)
            n_skip = sum(c.skipped for c in changes)
            logger.info(
                "slimact.apply %s: %d change(s), %d skipped",
                cfg.name,
                len(changes) - n_skip,
                n_skip,
            )
            for c in changes:
                logger.debug("  %s %s %s", "skip" if c.skipped else c.action, c.path, c.detail)
    except BaseException as exc:
        _undo_all(done, exc)
        prune(model)
        raise
    st = state_of(model)
    st.applied.extend(done)
    st.strategies.extend(label for label, _ in parts)
    return wrapper


def is_compiled_root(model: object) -> bool:
    """Is ``model`` wrapped whole by ``torch.compile`` (an ``OptimizedModule``)?"""
    return isinstance(model, nn.Module) and any(
        c.__name__ == "OptimizedModule" and c.__module__.startswith("torch._dynamo")
        for c in type(model).__mro__
    )


def refuse_compiled_root(model: object, who: str) -> None:
    """A clear ``TypeError`` for a model wrapped whole by ``torch.compile``, naming the way."""
    if is_compiled_root(model):
        raise TypeError(
            f"{who} got a model compiled whole by torch.compile ({type(model).__name__} around "
            f"{type(model._orig_mod).__name__}): its forward is one compiled graph that "
            "slimact's hooks cannot enter, so slimact would silently do nothing to it. Pass the "
            "plain model and let slimact compile it: slimact.apply(model, spec, compile=True) "
            "(--compile) compiles every block with the strategy's actions inside (or "
            "model._orig_mod to work on the uncompiled model)"
        )


def _undo_all(changes: list[AppliedChange], exc: BaseException) -> None:
    """Undo ``changes`` newest first; a failing undo is noted on ``exc``, not raised over it."""
    for change in reversed(changes):
        if change.undo is None:
            continue
        try:
            change.undo()
        except Exception as undo_exc:  # keep undoing: the original error is the one to report
            exc.add_note(f"slimact: undoing {change.action} at {change.path!r} failed: {undo_exc}")


def applied(model: nn.Module) -> list[AppliedChange]:
    """The changes ``apply`` made to ``model`` (skipped sites included, with their reasons);
    through a wrapper, to the model it wraps."""
    st = peek(model)
    return list(st.applied) if st is not None else []


def applied_strategies(model: nn.Module) -> list[str]:
    """The strategies ``apply`` applied to ``model``, in order, as named in their specs."""
    st = peek(model)
    return list(st.strategies) if st is not None else []


def revert(model: nn.Module) -> nn.Module:
    """Undo every change ``apply`` made, newest first; through a wrapper (``PeftModel``, DDP),
    to the model it wraps, wherever ``apply`` was given (the wrapper or the model)."""
    st = peek(model)
    if st is None:
        return model
    changes, st.applied, st.strategies = st.applied, [], []
    for change in reversed(changes):
        if change.undo is not None:
            change.undo()
    prune(model)
    return model

"""The compiled strategies as plans: ``compiled_plan_of(model, "compiled-int8")`` -> one
``CompiledPlan``, the compiled counterpart of ``plan_of`` (``strategies/presets.py``).

Every compiled strategy is a choice per block (``BlockChoice``: compile's region budget, a
traced codec, offload) and one for the eager root, i.e. a ``CompiledPlan``
(``slimact.planner.compiled``), and every one installs through the one install path,
``compiled_auto.install_compiled``:

    compiled-none, -int8, -int6, -int4,     the same choice for every block (the config's
    -int4-outlier, -prac, -recompute,       ``choice``), the root kept; registered here from
    -offload (``@<budget>``, ``sr``)        ``slimact.compiled.strategies.PRESETS``
    compiled-auto@<budget>                  the plan its planner solves on a batch
                                            (``example=(ids, targets)``, or its own
                                            ``batch``/``seq``)
    an eager name under ``compile=True``    its compiled form (``registry.compiled_spec``:
                                            ``int8`` -> ``compiled-int8``, ``int8+recompute``
                                            -> ``compiled-int8@0``)

A spec whose compiled form has eager parts before the blocks (``invact`` ->
``invact@ops=none+compiled-none``, ``chunked-ce+int8`` -> ``chunked-ce+compiled-int8``) is one
plan too: those compile-safe parts (``invact@ops=none``, ``invact-act``, ``chunked-ce``, ``cola``;
their ``plan_of``) are its eager part (``CompiledPlan.eager``), installed on the plan runtime before
the blocks compile; ``compiled-auto`` after such parts is solved on a copy that carries them.
A root option (``compiled-auto``'s) then runs on the runtime merged with the eager part into one
plan (``CompiledPlan.runtime_plan``; a conflicting site is refused). A spec written with a
``compiled-*`` part is read as written (``invact+compiled-int8`` inverts the activations too,
as ``slimact.apply(model, spec)`` does); one without, as ``compile=True`` rewrites it. An eager
part with no plan form is refused, naming it (every compile-safe strategy is a preset, with any
settings: ``chunked-ce@256``, ``cola``).

``slimact.apply(model, plan)`` (``compile=True`` or not) applies a ``CompiledPlan`` through the
``compiled-plan`` strategy (``registry.register_config_type``): the same saved bytes, choices,
action per site and gradients as the strategy it came from (``tests/test_compiled_presets.py``).
``slimact.apply(model, spec, compile=True)`` of a fixed compiled spec on an unchanged model
installs that same plan (``apply_compiled_spec``, a registry preset path), showing the eager
parts' own rows and naming the spec's parts in ``slimact.applied_strategies``. The rest goes
part by part (each eager part by its strategy's own transform, then the blocks):
``compiled-auto``, which plans on the first training forward, when there is no plan to install
yet, a ``filter_fn``, and a model with earlier changes to compose with.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import operator
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from slimact import sites
from slimact.checkpointing import GUARD_ACTION
from slimact.compiled.strategies import PRESETS, RENAMED_STRATEGIES, CompiledCodecConfig
from slimact.hf_inputs import random_token_batch
from slimact.planner.apply import runtime_of
from slimact.planner.compiled import CompiledPlan
from slimact.planner.plan import Plan
from slimact.registry import (
    AppliedChange,
    FilterFn,
    StrategyConfig,
    compile_safe,
    compiled_spec,
    parts_one_by_one,
    register_config_type,
    register_preset_path,
    register_rename,
    register_strategy,
    resolve,
    transform_of,
)
from slimact.spec import compiles_blocks
from slimact.state import peek, state_of
from slimact.strategies.compiled_auto import (
    CompiledAutoConfig,
    check_blocks,
    install_compiled,
    plan_compiled,
)
from slimact.strategies.presets import plan_and_rows, plan_of

PLAN_NAME = "compiled-plan"


@dataclass(frozen=True)
class CompiledPlanConfig(StrategyConfig):
    """A solved ``CompiledPlan`` as a strategy config: what ``slimact.apply(model, plan)`` turns
    the plan into (None: the bare name, which carries no plan and is refused)."""

    plan: CompiledPlan | None = field(default=None, hash=False)


Example = tuple[torch.Tensor, torch.Tensor]


def compiled_plan_of(
    model: nn.Module,
    strategy: str | StrategyConfig | CompiledPlan,
    *,
    example: Example | None = None,
) -> CompiledPlan:
    """The ``CompiledPlan`` that does on ``model`` what ``strategy`` does (module docstring):
    a ``compiled-*`` spec or config, or an eager spec with a compiled form, whose compile-safe
    eager parts (``invact@ops=none``, ``invact-act``, ``chunked-ce``) become the plan's eager
    part (``plan_of`` of them; ``model`` must carry no slimact change). ``compiled-auto``
    solves its plan on ``example`` (token ids, targets), or on its own ``batch``/``seq``, on a
    copy of the model with the eager parts applied (the same cached profile and solver as the
    strategy; ``model`` is left as it was)."""
    eager, config = _compiled_config(strategy)
    if isinstance(config, CompiledPlanConfig):
        if config.plan is None:
            raise ValueError(_NO_PLAN)
        return config.plan
    eager_plan = _eager_plan(model, strategy, eager)
    if isinstance(config, CompiledCodecConfig):
        return _uniform(model, config, eager_plan)
    plan = _solved(model, config, example, eager)
    plan.eager = eager_plan
    return plan


def _uniform(model: nn.Module, config: CompiledCodecConfig, eager: Plan | None) -> CompiledPlan:
    """A fixed compiled strategy's plan: its choice for every block, the root kept."""
    return CompiledPlan(
        choices={path: config.choice for path in sites.block_paths(model)},
        budget="",
        allowed_bytes=0,
        predicted_bytes=0,
        predicted_seconds=0.0,
        baseline_bytes=0,
        meta={"strategy": config.name},
        eager=eager,
    )


_COMPILED_KINDS = (CompiledCodecConfig, CompiledAutoConfig, CompiledPlanConfig)


def _compiled_config(strategy: object) -> tuple[list[StrategyConfig], StrategyConfig]:
    """The eager parts and the one compiled config of ``strategy``, or a ValueError: a spec
    with a ``compiled-*`` part as it is written (what ``slimact.apply(model, spec)`` does), an
    eager one as ``compile=True`` rewrites it (``registry.compiled_spec``)."""
    spec = strategy
    if isinstance(strategy, str):
        rewritten = compiled_spec(strategy)  # (also refuses two compiled forms of the blocks)
        written = compiles_blocks(strategy)
        spec = strategy if written else rewritten
    configs = resolve(spec)
    compiled = [c for c in configs if isinstance(c, _COMPILED_KINDS)]
    eager = [c for c in configs if not isinstance(c, _COMPILED_KINDS)]
    unsafe = [c.name for c in eager if not compile_safe(c)]
    if len(compiled) == 1 and not unsafe:
        if eager and isinstance(compiled[0], CompiledPlanConfig):
            raise ValueError(
                f"{strategy!r}: a solved CompiledPlan is the whole plan; its eager part is its "
                "own (CompiledPlan.eager), not another part of the spec"
            )
        return eager, compiled[0]
    raise ValueError(
        f"{strategy!r} is not one compiled plan: under compile=True it is {spec!r}, whose "
        f"part(s) {', '.join(unsafe or [c.name for c in eager])} are neither a choice per block "
        f"nor an eager part applied before the blocks compile; a compiled plan comes from "
        f"{', '.join(PRESETS)}, compiled-auto@<budget>, or an eager strategy whose compiled "
        "form is one of them (int8, int4, prac, recompute, offload, none, auto@<budget>), "
        "after the compile-safe eager parts (invact, invact-act, chunked-ce, cola)"
    )


def _eager_plan(model: nn.Module, strategy: object, eager: list[StrategyConfig]) -> Plan | None:
    """``plan_of`` of the eager parts (None without any), or a ValueError naming the spec."""
    if not eager:
        return None
    try:
        return functools.reduce(operator.add, [plan_of(model, c) for c in eager])
    except ValueError as e:
        raise ValueError(
            f"{strategy!r} under compile=True has an eager part with no plan form: {e}"
        ) from e


def _solved(
    model: nn.Module,
    config: CompiledAutoConfig,
    example: Example | None,
    eager: list[StrategyConfig] = (),
) -> CompiledPlan:
    """What ``compiled-auto`` installs: its planner run on a copy of ``model`` that carries
    the eager parts as ``apply`` puts them before it (each strategy's own transform), undone."""
    if config.budget is None:
        raise ValueError(
            "compiled-auto needs a memory budget: compiled_plan_of(model, 'compiled-auto@25%', "
            "example=(ids, targets))"
        )
    if example is not None:
        ids, targets = example
    elif config.batch is not None:
        ids, targets = random_token_batch(
            model, config.batch, config.seq, config.seed, "CompiledAutoConfig"
        )
    else:
        raise ValueError(
            f"compiled-auto (budget {config.budget}) solves its plan on a batch; give one: "
            "compiled_plan_of(model, spec, example=(ids, targets)) (the batch its first training "
            "forward would see), or CompiledAutoConfig(budget=..., batch=B, seq=S)"
        )
    work = copy.deepcopy(model)
    with parts_one_by_one():  # as apply's part-by-part path: the runtime is compiled-auto's
        changes = [c for part in eager for c in transform_of(part)(work, part, None)]
    changes += plan_compiled(work, config, ids, targets)
    plan = state_of(work).compiled_plan
    for c in reversed(changes):
        if c.undo is not None:
            c.undo()
    return plan


_NO_PLAN = (
    "strategy 'compiled-plan' needs a solved CompiledPlan: slimact.apply(model, "
    "compiled_plan_of(model, spec)) or CompiledPlan.from_dict(...); the bare name carries no plan"
)


def apply_compiled_spec(
    model: nn.Module, configs: list[StrategyConfig], filter_fn: FilterFn | None
) -> list[AppliedChange] | None:
    """``slimact.apply`` of a spec that is one fixed compiled plan (a ``compiled-*`` preset
    after compile-safe eager parts: what ``compile=True`` makes of ``int8``, ``invact+int4``,
    ``chunked-ce+recompute``) on a model that carries no slimact change: its ``CompiledPlan``
    installed, the path ``slimact.apply(model, compiled_plan_of(model, spec))`` takes, so the
    two are one by construction. None (nothing changed) for any other spec (``compiled-auto``
    plans lazily; a ``filter_fn``, or earlier changes to compose with), which ``apply``
    applies part by part (a registry preset path, after the eager presets')."""
    compiled = [c for c in configs if isinstance(c, _COMPILED_KINDS)]
    eager = [c for c in configs if not isinstance(c, _COMPILED_KINDS)]
    if filter_fn is not None or len(compiled) != 1:
        return None
    if not isinstance(compiled[0], CompiledCodecConfig) or not all(map(compile_safe, eager)):
        return None
    st = peek(model)
    if runtime_of(model) is not None or (st is not None and (st.applied or st.stateful)):
        return None
    try:
        eager_plan, rows = plan_and_rows(model, eager) if eager else (None, [])
    except ValueError:
        return None  # a part with no plan form: its own transform says what is wrong
    changes = install_compiled(model, _uniform(model, compiled[0], eager_plan))
    if eager_plan is None or not any(not c.skipped for c in rows):
        return changes
    # the eager part's rows as its strategies report them (as a spec of presets shows them),
    # the first one undoing the runtime, then the runtime's other rows and the blocks'
    head, *rest = changes
    out = [dataclasses.replace(c, undo=None) for c in rows]
    next(c for c in out if not c.skipped).undo = head.undo
    return [*out, *(c for c in rest if c.action in ("compile", GUARD_ACTION))]


def apply_compiled_plan(
    model: nn.Module, config: CompiledPlanConfig, filter_fn: FilterFn | None = None
) -> list[AppliedChange]:
    if config.plan is None:
        raise ValueError(_NO_PLAN)
    check_blocks(model, config.plan)
    return install_compiled(model, config.plan, filter_fn)


def apply_compiled_preset(
    model: nn.Module, config: CompiledCodecConfig, filter_fn: FilterFn | None = None
) -> list[AppliedChange]:
    """A fixed compiled strategy: its uniform plan, installed."""
    return install_compiled(model, compiled_plan_of(model, config), filter_fn)


for _name, (_config, _description) in PRESETS.items():
    register_strategy(
        _name, _config, apply_compiled_preset, _description, codec_policy=_config.is_codec_policy
    )
for _old, _new in RENAMED_STRATEGIES.items():
    register_rename(_old, _new)
register_strategy(
    PLAN_NAME,
    CompiledPlanConfig(),
    apply_compiled_plan,
    "apply a solved slimact.planner.compiled.CompiledPlan (compiled_plan_of, compiled-auto's)",
    codec_policy=True,  # its root may take an eager codec on the plan runtime
)
register_config_type(CompiledPlan, lambda plan: CompiledPlanConfig(plan))
register_preset_path(apply_compiled_spec)

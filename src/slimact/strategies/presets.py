"""The fixed-rule strategies as plans: ``plan_of(model, "invact+int4")`` -> one ``Plan``.

A *preset* is a strategy whose effect a ``Plan`` states in full, so that applying the plan (the
one plan runtime, ``slimact.planner.apply``) does what applying the strategy does: the same
saved bytes, the same action per site and bit-identical gradients (``tests/test_presets.py``
checks each). Each config type has one handler (torchao's shape: dispatch by config type):

    none                  the empty plan: every site keeps its tensor
    recompute             every block (or those ``filter_fn`` passes) recomputed whole
    int4, int8, ...       the config's lazy rule, role -> codec (``Int4Config.plan``)
    invact, invact-act    the modules the strategy would invert, as ``reform`` per block
    chunked-ce            the loss head, as ``reform`` of the root's row
    prac, pac, rac        PRAC's lazy rule (its roles -> codec labels with the ranks) and its
                          fused RMSNorms as ``reform`` (``prac_plan``; the strategy installs it)

``invact`` and ``chunked-ce`` find their modules as the strategy does (its probe included):
the strategy is applied to the model, its changes read, and undone, so the model is left as it
was. The runtime reformulates with the default settings, so a config with other settings
(``invact@bf16=exact-near-branch``, ``chunked-ce@256``) has no preset yet and is refused, as
are the strategies that are not presets (``cola-m``, ``auto``: a solved plan comes
from ``slimact plan``; ``compiled-*``). A spec with ``+`` merges its parts' plans
(``Plan.merge``), which names every site where two parts conflict. A plan is applied in the
runtime's one order (reformulate, recompute, then codecs), whatever the order of the spec's
parts; the registry's ``+`` applies parts in spec order, and ``int4`` installed before
``chunked-ce`` codes some block tensors differently, so the preset matches the spec written in
the runtime's order (``invact+chunked-ce+int4``).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Callable

import torch.nn as nn

from slimact import sites
from slimact.actions import FUSED_RMS
from slimact.planner.plan import LayerPlan, Plan
from slimact.reformulate import (
    ChunkedCEConfig,
    InvActConfig,
    apply_chunked_ce,
    apply_invact,
    fusable_rms_norms,
)
from slimact.registry import FilterFn, StrategyConfig, resolve
from slimact.state import peek
from slimact.strategies.int4 import Int4Config, NaiveInt4Config
from slimact.strategies.none import NoneConfig
from slimact.strategies.prac_config import PacConfig, PracConfig, RacConfig
from slimact.strategies.recompute import RecomputeConfig


def _layers(
    model: nn.Module, field: str, paths: list[str], kinds: dict[str, str] | None = None
) -> tuple[LayerPlan, ...]:
    """``paths`` (absolute module paths) as one ``LayerPlan`` per block, ``field`` holding each
    path relative to its block (and ``reform_kinds`` its kind from ``kinds``); paths outside
    every block go to the root's row (block "")."""
    blocks = sites.block_paths(model)
    modules = dict(model.named_modules())
    rows: dict[str, list[tuple[str, str]]] = {}
    for path in paths:
        owner = next((b for b in blocks if path == b or path.startswith(b + ".")), "")
        rel = path[len(owner) + 1 :] if owner and path != owner else ("" if owner else path)
        rows.setdefault(owner, []).append((rel, (kinds or {}).get(path, "")))
    return tuple(
        LayerPlan(
            block=b,
            kind=type(modules[b]).__name__ if b else type(model).__name__,
            **{field: tuple(rel for rel, _ in rows[b])},
            reform_kinds=tuple((rel, k) for rel, k in rows[b] if k),
        )
        for b in [*blocks, ""]
        if b in rows
    )


def _none(model: nn.Module, config: NoneConfig, filter_fn: FilterFn | None) -> Plan:
    return Plan(meta=(("strategy", "none"),))


def _recompute(model: nn.Module, config: RecomputeConfig, filter_fn: FilterFn | None) -> Plan:
    if not config.preserve_rng_state:
        raise ValueError(
            "recompute with preserve_rng_state=False has no preset: the plan runtime "
            "checkpoints with the RNG state preserved"
        )
    modules = dict(model.named_modules())
    paths = [b for b in sites.block_paths(model) if filter_fn is None or filter_fn(modules[b], b)]
    if not paths:
        raise ValueError("recompute: the model has no repeated blocks to recompute")
    return Plan(layers=_layers(model, "recompute", paths), meta=(("strategy", "recompute"),))


def _rule(model: nn.Module, config: Int4Config | NaiveInt4Config, filter_fn) -> Plan:
    if filter_fn is not None:
        raise ValueError(f"{config.name}: a filter_fn has no preset form (apply the strategy)")
    return config.plan()


def _reformulated(apply_fn: Callable, model: nn.Module, config, filter_fn) -> dict[str, str]:
    """The modules ``apply_fn`` would reformulate -> their kind (``invact:silu``, ...), found by
    applying it and undoing it."""
    changes = apply_fn(model, config, filter_fn)
    try:
        modules = dict(model.named_modules())
        return {c.path: c.action for c in changes if not c.skipped and c.path and c.path in modules}
    finally:
        for c in reversed(changes):
            if c.undo is not None:
                c.undo()


def _only_defaults(config: StrategyConfig, default: StrategyConfig, free: tuple[str, ...]) -> None:
    diff = [
        f.name
        for f in dataclasses.fields(default)
        if f.name not in free and getattr(config, f.name) != getattr(default, f.name)
    ]
    if diff:
        raise ValueError(
            f"{config.name} with {', '.join(f'{k}={getattr(config, k)!r}' for k in diff)} has "
            "no preset: the plan runtime reformulates with the default settings (apply the "
            "strategy itself)"
        )


def _invact(model: nn.Module, config: InvActConfig, filter_fn: FilterFn | None) -> Plan:
    _only_defaults(config, InvActConfig(), ("norms", "ops", "probe"))
    kinds = _reformulated(apply_invact, model, config, filter_fn)
    meta = (("strategy", "invact" if config.norms else "invact-act"),)
    return Plan(layers=_layers(model, "reform", list(kinds), kinds), meta=meta)


def _chunked_ce(model: nn.Module, config: ChunkedCEConfig, filter_fn: FilterFn | None) -> Plan:
    _only_defaults(config, ChunkedCEConfig(), ("probe",))
    kinds = _reformulated(apply_chunked_ce, model, config, filter_fn)
    return Plan(
        layers=_layers(model, "reform", list(kinds), kinds), meta=(("strategy", "chunked-ce"),)
    )


def prac_plan(model: nn.Module, config: PracConfig, filter_fn: FilterFn | None = None) -> Plan:
    """PRAC's plan: its lazy rule (``PracConfig.rule``: PRAC's roles -> codec labels carrying the
    ranks) and, with ``fuse_norms``, the RMSNorms ``filter_fn`` passes reformulated to save (x,
    rstd) (kind ``rms-norm``). The strategy installs it; ``filter_fn`` also restricts the rule,
    which a plan cannot say (the strategy hands it to the runtime's PRAC state)."""
    paths = fusable_rms_norms(model, filter_fn) if config.fuse_norms else []
    return Plan(
        layers=_layers(model, "reform", paths, dict.fromkeys(paths, FUSED_RMS)),
        rules=(config.rule(),),
        meta=(("strategy", config.name),),
    )


def _prac(model: nn.Module, config: PracConfig, filter_fn: FilterFn | None) -> Plan:
    if filter_fn is not None:
        raise ValueError(f"{config.name}: a filter_fn has no preset form (apply the strategy)")
    return prac_plan(model, config)


# config type -> handler (model, config, filter_fn) -> Plan
PRESETS: dict[type, Callable[..., Plan]] = {
    NoneConfig: _none,
    RecomputeConfig: _recompute,
    Int4Config: _rule,
    NaiveInt4Config: _rule,
    InvActConfig: _invact,
    ChunkedCEConfig: _chunked_ce,
    PracConfig: _prac,
    PacConfig: _prac,
    RacConfig: _prac,
}


def plan_of(model: nn.Module, strategy: str | StrategyConfig, filter_fn: FilterFn | None = None):
    """The ``Plan`` that does on ``model`` what ``strategy`` does (module docstring); a spec
    with ``+`` merges its parts' plans. The model must carry no slimact change."""
    st = peek(model)
    if st is not None and (st.applied or st.runtime is not None):
        raise ValueError("plan_of needs a model without slimact changes (slimact.revert first)")
    plans = []
    for config in resolve(strategy):
        handler = PRESETS.get(type(config))
        if handler is None:
            raise ValueError(
                f"strategy {config.name!r} has no preset plan; presets: none, recompute, int4, "
                "int4-plain, int4-paper, int4-naive, int8, invact, invact-act, chunked-ce, prac, "
                "pac, rac and their '+' compositions (auto's plan: slimact plan --budget ...)"
            )
        plans.append(handler(model, config, filter_fn))
    return functools.reduce(operator.add, plans)

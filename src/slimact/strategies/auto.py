"""``auto``: the planner as a strategy; ``plan``: apply a saved ``Plan``.

``auto`` profiles the model, solves the MILP of ``slimact.planner.milp`` under a memory budget
and applies the plan (recompute, codecs, invact, per storage and per block). Without ``batch``
and ``seq`` it plans on the first training forward, on that very batch (see
``slimact.planner.apply``); with them it plans at ``apply`` time on random tokens of that shape.

``AutoConfig(budget="25%")`` budgets a fraction of the baseline activation bytes;
``AutoConfig(budget="6GiB")`` budgets device memory, static memory (parameters, gradients,
AdamW states) included. Strategy names ``auto@10%``, ``auto@25%``, ``auto@50%`` are registered
for command lines; ``AutoConfig.from_spec("auto@30%")`` parses any ``auto@<budget>``.

Specs take options after the budget: ``auto@25%,codecs=int4/int8,repeats=1,layers=uniform``
(fields ``layers``, ``codecs`` (``/``-separated), ``repeats``, ``reform``, ``recompute``,
``max_rel_err``, ``max_grad_err`` (``none`` for no cap), ``cache`` (``none``: no cache)).

Both strategies install a ``BudgetCheck`` (``slimact.planner.adaptive``): the first training
forward's measured stored bytes are compared with the budget; a plan solved under other
conditions or more than 2% over is re-planned (``auto``: profiled again, cache bypassed), and a
miss that remains is a loud ``BudgetWarning`` naming the budget, the bytes and the gap.

``slimact.apply(model, plan)`` with a ``Plan`` (``slimact.planner.Plan.load(path)``) applies it
as solved; the registered name ``plan`` itself carries no plan and refuses to apply.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn as nn

from slimact.budget import Budget
from slimact.codecs.base import codec_names
from slimact.hf_inputs import random_token_batch, refuse_unless_token_ids
from slimact.planner.adaptive import BudgetCheck
from slimact.planner.apply import install
from slimact.planner.milp import DEFAULT_MAX_GRAD_ERR, LAYER_MODES
from slimact.planner.plan import Plan
from slimact.planner.profile import cached_profile, profile_model
from slimact.planner.solve import solve_plan
from slimact.registry import AppliedChange, FilterFn, StrategyConfig, register_strategy


@dataclass(frozen=True)
class AutoConfig(StrategyConfig):
    """``budget``: '25%' | '6GiB' | bytes (required). ``layers``: 'uniform' (Adacc: one plan
    for all blocks of a kind) | 'ends' (first, middle, last) | 'each'. ``codecs``: candidate
    codec names (None: all registered). ``max_quality``: cap on the summed relative MSE of
    encoded tensors; ``max_rel_err``: per-tensor cap on the relative L2 error of a
    codec's reconstruction (default 0.25 admits INT4/INT8 but, at the paper's ranks, not PRAC's
    unbiased but noisy subspace estimates, 0.3-1.1; None admits every codec). ``max_grad_err``:
    the training-aware cap: per block and parameter, the summed 1 - cosine of the gradient that
    the chosen codecs cost, measured while profiling (``slimact.planner.gradstats``; see
    ``DEFAULT_MAX_GRAD_ERR`` in ``slimact.planner.milp``; None: no cap). ``cache``: profile JSON cache directory
    ('' = ~/.cache/slimact, None = no cache). ``batch``/``seq``: plan at apply time."""

    budget: Budget | str | int | None = None  # a Budget after __post_init__
    layers: str = "ends"
    codecs: tuple[str, ...] | None = None
    recompute: bool = True
    reform: bool = True
    max_quality: float | None = None
    max_rel_err: float | None = 0.25
    max_grad_err: float | None = DEFAULT_MAX_GRAD_ERR
    include_static: bool = True
    repeats: int = 3
    cache: str | None = ""
    batch: int | None = None
    seq: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.budget is not None:  # parsed once, here: a malformed budget raises
            object.__setattr__(self, "budget", Budget.parse(self.budget))
        if self.layers not in LAYER_MODES:
            raise ValueError(f"AutoConfig.layers must be one of {LAYER_MODES}, got {self.layers!r}")
        if self.codecs is not None:
            object.__setattr__(self, "codecs", tuple(self.codecs))
            bad = [c for c in self.codecs if c not in codec_names()]
            if bad:
                raise ValueError(f"unknown codec(s) {bad}; valid: {', '.join(codec_names())}")
        for name in ("max_quality", "max_rel_err", "max_grad_err"):
            v = getattr(self, name)
            if v is not None and not v >= 0:
                raise ValueError(f"AutoConfig.{name} must be >= 0 or None, got {v!r}")
        if not isinstance(self.repeats, int) or self.repeats < 1:
            raise ValueError(f"AutoConfig.repeats must be an int >= 1, got {self.repeats!r}")
        if (self.batch is None) != (self.seq is None):
            raise ValueError("AutoConfig: give both batch and seq, or neither (plan lazily)")
        for name in ("batch", "seq"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"AutoConfig.{name} must be an int >= 1, got {v!r}")

    @classmethod
    def from_spec(cls, spec: str, **overrides) -> AutoConfig:
        """``"auto@25%"`` or ``"25%"`` -> ``AutoConfig(budget="25%", **overrides)``; options may
        follow the budget: ``"auto@25%,codecs=int4/int8,repeats=1"`` (see the module docstring)."""
        body = spec.split("@", 1)[1] if "@" in spec else spec
        budget, *items = [part.strip() for part in body.split(",")]
        kwargs: dict = {}
        for item in filter(None, items):
            key, sep, value = (x.strip() for x in item.partition("="))
            conv = _SPEC_FIELDS.get(key)
            if not sep or conv is None:
                raise ValueError(
                    f"strategy spec {spec!r}: {item!r} must be key=value with key one of "
                    f"{', '.join(_SPEC_FIELDS)}"
                )
            try:
                kwargs[key] = conv(value)
            except ValueError:
                raise ValueError(
                    f"strategy spec {spec!r}: bad value for {key}: {value!r}"
                ) from None
        return cls(budget=budget, **{**kwargs, **overrides})


def _flag(text: str) -> bool:
    low = text.lower()
    if low not in ("1", "0", "true", "false", "yes", "no"):
        raise ValueError(text)
    return low in ("1", "true", "yes")


def _none_or(conv):  # type: ignore[no-untyped-def]
    return lambda text: None if text.lower() == "none" else conv(text)


_SPEC_FIELDS = {
    "layers": str,
    "codecs": lambda text: tuple(c.strip() for c in text.split("/") if c.strip()),
    "repeats": int,
    "reform": _flag,
    "recompute": _flag,
    "max_rel_err": _none_or(float),
    "max_grad_err": _none_or(float),
    "max_quality": _none_or(float),
    "cache": _none_or(str),
}


def solve_options(config: AutoConfig) -> dict:
    return dict(
        layers=config.layers, codecs=config.codecs, recompute=config.recompute,
        reform=config.reform, max_quality=config.max_quality, max_rel_err=config.max_rel_err,
        max_grad_err=config.max_grad_err, include_static=config.include_static,
    )  # fmt: skip


def plan_model(
    model: nn.Module,
    config: AutoConfig,
    input_ids: torch.Tensor,
    targets=None,
    return_profile: bool = False,
    refresh: bool = False,
):
    """Profile ``model`` on ``input_ids`` (cached if configured) and solve for the budget;
    ``return_profile``: return (plan, profile); ``refresh``: profile again, whatever is cached."""
    name = type(model).__name__
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "d_model"):
        name = f"{name}-d{cfg.d_model}-L{getattr(cfg, 'n_layers', '?')}"
    kw = dict(codecs=config.codecs, repeats=config.repeats, reform=config.reform, name=name)
    if config.cache is None:
        prof = profile_model(model, input_ids, targets, **kw)
    else:
        prof = cached_profile(
            model, input_ids, targets, cache_dir=config.cache or None, refresh=refresh, **kw
        )
    plan = solve_plan(prof, config.budget, **solve_options(config))
    return (plan, prof) if return_profile else plan


def apply_auto(
    model: nn.Module, config: AutoConfig, filter_fn: FilterFn | None = None
) -> list[AppliedChange]:
    if config.budget is None:
        raise ValueError(
            "strategy 'auto' needs a memory budget: use 'auto@25%' (a share of the baseline "
            "activation memory), AutoConfig(budget='6GiB') (device memory), or --budget"
        )
    if filter_fn is not None:
        raise ValueError("strategy 'auto' plans the whole model; filter_fn is not supported")
    refuse_unless_token_ids(model, "auto", "its planner profiles model(input_ids) on token ids")
    planner = functools.partial(plan_model, model, config, return_profile=True)
    replanner = functools.partial(planner, refresh=True)
    opts = solve_options(config)
    if config.batch is None:
        return _checked(model, install(model, planner=planner, solve_options=opts), replanner)
    ids, targets = random_token_batch(model, config.batch, config.seq, config.seed, "AutoConfig")
    was = model.training
    model.train()
    try:
        plan, prof = planner(ids, targets)
    finally:
        model.train(was)
    changes = install(model, plan=plan, planner=planner, profile=prof, solve_options=opts)
    return _checked(model, changes, replanner)


def _checked(model: nn.Module, changes: list[AppliedChange], replanner=None):  # type: ignore[no-untyped-def]
    """Add the first-step ``BudgetCheck`` (undone before the runtime by ``slimact.revert``)."""
    check = BudgetCheck(model, replanner=replanner)
    what = "re-plans if over" if replanner is not None else "warns if over"
    head = AppliedChange("", "budget-check", f"first step vs budget; {what}", undo=check.remove)
    return [*changes, head]


def apply_plan(model: nn.Module, plan: Plan, filter_fn: FilterFn | None = None):
    described = dict(plan.meta).get("describes")
    if described:
        raise ValueError(
            f"this Plan describes what strategy {described!r} does (slimact.planner.describe); "
            f"apply the strategy itself: slimact.apply(model, {described!r})"
        )
    if not plan.layers:
        raise ValueError(
            "strategy 'plan' needs a solved Plan: slimact.apply(model, Plan.load(path)) or "
            "slimact.planner.plan_for(...); the bare name carries no plan"
        )
    return _checked(model, install(model, plan=plan, filter_fn=filter_fn))


register_strategy(
    "auto",
    AutoConfig(),
    apply_auto,
    "MILP planner over recompute/codecs/invact per storage under a budget (needs a budget)",
)
for _pct in ("10%", "25%", "50%"):
    register_strategy(
        f"auto@{_pct}", AutoConfig(budget=_pct), apply_auto, f"auto with budget {_pct}"
    )
register_strategy("plan", Plan(), apply_plan, "apply a solved slimact.planner.Plan object")

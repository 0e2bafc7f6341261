"""The ``auto`` planner's configuration and its one entry: profile a model, solve for a budget.

``AutoConfig`` holds every knob of the planner (budget, layer grouping, candidate codecs, quality
caps, profile cache, batch shape); ``AutoConfig.from_spec("auto@25%,codecs=int4/int8")`` parses
a strategy spec. :func:`plan_model` profiles a model on a batch (cached if configured) and solves
the MILP of ``slimact.planner.milp`` for the budget; :func:`plan_for` does so on random tokens of
a given shape. The ``auto`` and ``plan`` strategies (``slimact.strategies.auto``) apply the
result; this module is their planner half, so the planner package never imports a strategy.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn as nn

from slimact import spec
from slimact.budget import Budget
from slimact.codecs.base import codec_names
from slimact.hf_inputs import random_token_batch
from slimact.planner.milp import DEFAULT_MAX_GRAD_ERR, LAYER_MODES
from slimact.planner.offload import parse_host_budget
from slimact.planner.plan import Plan
from slimact.planner.profile import cached_profile, profile_model
from slimact.planner.solve import solve_plan
from slimact.registry import StrategyConfig
from slimact.spec import flag, listed, optional


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
    ('' = ~/.cache/slimact, None = no cache). ``batch``/``seq``: plan at apply time.
    ``host_budget``: pinned host memory the plan may offload saved tensors to ('8GiB' or bytes;
    None: no offload; CUDA only, refused when planning on a CPU), ``slimact.planner.offload``."""

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
    host_budget: str | int | None = None

    # what a spec sets beside its budget (``auto@25%,codecs=int4/int8``: ``slimact.spec``)
    spec_budget: ClassVar = True
    spec_fields: ClassVar = {
        "layers": str, "codecs": listed(), "repeats": int, "reform": flag, "recompute": flag,
        "max_rel_err": optional(float), "max_grad_err": optional(float),
        "max_quality": optional(float), "cache": optional(str), "host_budget": optional(str),
    }  # fmt: skip

    def __post_init__(self) -> None:
        if self.budget is not None:  # parsed once, here: a malformed budget raises
            object.__setattr__(self, "budget", spec.parse_budget(self.budget))
        parse_host_budget(self.host_budget)  # a malformed or relative one raises here
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
    def from_spec(cls, text: str, **overrides) -> AutoConfig:
        """``"auto@25%,codecs=int4/int8,repeats=1"`` -> its config (``slimact.spec``), with
        ``overrides`` set."""
        return dataclasses.replace(spec.configure(cls(), spec.parse_part(text)), **overrides)


def solve_options(config: AutoConfig) -> dict:
    return dict(
        layers=config.layers, codecs=config.codecs, recompute=config.recompute,
        reform=config.reform, max_quality=config.max_quality, max_rel_err=config.max_rel_err,
        max_grad_err=config.max_grad_err, include_static=config.include_static,
        host_budget=config.host_budget,
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


def plan_for(
    model: nn.Module, batch: int, seq: int, budget: str | int, seed: int = 0, **config
) -> Plan:
    """Profile ``model`` on random tokens of shape (batch, seq) and solve for ``budget``.

    ``config``: any ``AutoConfig`` field (``layers``, ``codecs``, ``max_quality``, ``cache`` ...).
    """
    cfg = AutoConfig(budget=budget, seed=seed, **config)
    ids, targets = random_token_batch(model, batch, seq, seed, "plan_for")
    was = model.training
    model.train()
    try:
        return plan_model(model, cfg, ids, targets)
    finally:
        model.train(was)


__all__ = ["AutoConfig", "plan_for", "plan_model", "solve_options"]

"""The planner: profile every saved tensor, solve a MILP under a memory budget, apply, re-plan.

adacc.txt §3.3-3.4 extended to every action slimact has (keep, recompute, each codec, invact):

    from slimact.planner import plan_for
    plan = plan_for(model, batch=4, seq=256, budget="25%")   # profile (cached) + MILP
    print(plan.table()); plan.save("plan.json")
    slimact.apply(model, plan)                             # or slimact.apply(model, "auto@25%")

Modules: ``profile`` (measurements), ``milp`` (the model and its solver), ``solve`` (budget -> ``Plan``),
``plan`` (the JSON data),
``apply`` (the runtime that installs a plan), ``adaptive`` (re-planning during training),
``cli`` (``slimact plan``).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from slimact.planner.adaptive import PlanEvolver, backoff_steps
from slimact.planner.apply import PlanRuntime, install, runtime_of
from slimact.planner.milp import Problem, brute_force
from slimact.planner.plan import LayerPlan, Plan, Profile, parse_budget
from slimact.planner.profile import cached_profile, profile_model, static_memory
from slimact.planner.solve import solve_plan


def plan_for(
    model: nn.Module, batch: int, seq: int, budget: str | int, seed: int = 0, **config
) -> Plan:
    """Profile ``model`` on random tokens of shape (batch, seq) and solve for ``budget``.

    ``config``: any ``AutoConfig`` field (``layers``, ``codecs``, ``max_quality``, ``cache`` ...).
    """
    from slimact.strategies.auto import AutoConfig, plan_model

    cfg = AutoConfig(budget=budget, seed=seed, **config)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
    ids = ids.to(next(model.parameters()).device)
    was = model.training
    model.train()
    try:
        return plan_model(model, cfg, ids[:, :-1], ids[:, 1:])
    finally:
        model.train(was)


__all__ = [
    "LayerPlan",
    "Plan",
    "PlanEvolver",
    "PlanRuntime",
    "Problem",
    "Profile",
    "backoff_steps",
    "brute_force",
    "cached_profile",
    "install",
    "parse_budget",
    "plan_for",
    "profile_model",
    "runtime_of",
    "solve_plan",
    "static_memory",
]

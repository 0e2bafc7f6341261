"""The planner: profile every saved tensor, solve a MILP under a memory budget, apply, re-plan.

adacc.txt §3.3-3.4 extended to every action slimact has (keep, recompute, each codec, invact):

    from slimact.planner import plan_for
    plan = plan_for(model, batch=4, seq=256, budget="25%")   # profile (cached) + MILP
    print(plan.table()); plan.save("plan.json")
    slimact.apply(model, plan)                             # or slimact.apply(model, "auto@25%")

Modules: ``profile`` (measurements), ``milp`` (the model; ``highs`` solves it), ``solve`` (budget -> ``Plan``),
``plan`` (the JSON data), ``auto`` (``AutoConfig``, ``plan_model``, ``plan_for``),
``apply`` (the runtime that installs a plan), ``adaptive`` (re-planning during training),
``cli`` (``slimact plan``).
"""

from __future__ import annotations

from slimact.planner.adaptive import PlanEvolver, backoff_steps
from slimact.planner.apply import PlanRuntime, install, runtime_of
from slimact.planner.auto import AutoConfig, plan_for
from slimact.planner.milp import Problem, brute_force
from slimact.planner.plan import LayerPlan, Plan, Profile, SiteRule, parse_budget
from slimact.planner.profile import cached_profile, profile_model, static_memory
from slimact.planner.solve import solve_plan

__all__ = [
    "AutoConfig",
    "LayerPlan",
    "Plan",
    "PlanEvolver",
    "PlanRuntime",
    "Problem",
    "Profile",
    "SiteRule",
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

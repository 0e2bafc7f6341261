"""``auto``: the planner as a strategy; ``plan``: apply a saved ``Plan``.

``auto`` profiles the model, solves the MILP of ``slimact.planner.milp`` under a memory budget
(``AutoConfig`` and ``plan_model`` live in ``slimact.planner.auto``) and applies the plan (recompute, codecs, invact, per storage and per block). Without ``batch``
and ``seq`` it plans on the first training forward, on that very batch (see
``slimact.planner.apply``); with them it plans at ``apply`` time on random tokens of that shape.

``AutoConfig(budget="25%")`` budgets a fraction of the baseline activation bytes;
``AutoConfig(budget="6GiB")`` budgets device memory, static memory (parameters, gradients,
AdamW states) included. Strategy names ``auto@10%``, ``auto@25%``, ``auto@50%`` are registered
for command lines; ``slimact.spec`` reads any ``auto@<budget>``.

Specs take options after the budget: ``auto@25%,codecs=int4/int8,repeats=1,layers=uniform``
(fields ``layers``, ``codecs`` (``/``-separated), ``repeats``, ``reform``, ``recompute``,
``max_rel_err``, ``max_grad_err`` (``none`` for no cap), ``cache`` (``none``: no cache)).

Both strategies install a ``BudgetCheck`` (``slimact.planner.adaptive``): the first training
forward's measured stored bytes are compared with the budget; a plan solved under other
conditions or more than 2% over is re-planned (``auto``: profiled again, cache bypassed), and a
miss that remains is a loud ``BudgetWarning`` naming the budget, the bytes and the gap.

``slimact.plan_of(model, "auto@25%", example=(input_ids, targets))`` returns the plan the strategy
solves on that first batch (its planner and profile cache), without installing it.

``slimact.apply(model, plan)`` with a ``Plan`` (``slimact.planner.Plan.load(path)``) applies it
as solved; the registered name ``plan`` itself carries no plan and refuses to apply.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from slimact import sites
from slimact.classify import label_arg
from slimact.codecs.offload import check_model
from slimact.hf_inputs import (
    TOKEN_INPUT,
    is_encoder_decoder,
    is_hf_model,
    main_input,
    random_token_batch,
    refuse_unless_token_ids,
)
from slimact.patching import run_all
from slimact.planner.adaptive import BudgetCheck
from slimact.planner.apply import install, runtime_of
from slimact.planner.auto import AutoConfig, plan_model, solve_options
from slimact.planner.plan import Plan
from slimact.registry import AppliedChange, FilterFn, register_strategy


def auto_refusal(config: AutoConfig, filter_fn: FilterFn | None) -> str:
    """Why ``auto`` cannot plan with ``config`` and ``filter_fn`` ("" where it can): the
    strategy's and its preset's (``presets.plan_of``) one check."""
    if config.budget is None:
        return (
            "strategy 'auto' needs a memory budget: use 'auto@25%' (a share of the baseline "
            "activation memory), AutoConfig(budget='6GiB') (device memory), or --budget"
        )
    if filter_fn is not None:
        return "strategy 'auto' plans the whole model; filter_fn is not supported"
    return ""


def refuse_unless_lm(model: nn.Module) -> None:
    """``auto`` profiles a training step, ``model(input_ids, targets)`` (Hugging Face:
    ``labels``): one clear ``ValueError`` for a model whose forward takes no targets (an
    ``nn.Sequential`` of linears), before anything is installed, not a ``TypeError`` from inside
    the profiler at the first forward."""
    refuse_unless_token_ids(model, "auto", "its planner profiles model(input_ids) on token ids")
    if label_arg(model) is None:
        raise ValueError(
            f"strategy 'auto' plans a language model: its planner profiles one training step, "
            f"model(input_ids, targets=...) (Hugging Face: labels=...), on token ids, and "
            f"{type(model).__name__}.forward takes no targets or labels; on this model use a "
            "fixed strategy (recompute, int4, int8, prac, invact) or a Plan of your own"
        )


def apply_auto(
    model: nn.Module, config: AutoConfig, filter_fn: FilterFn | None = None
) -> list[AppliedChange]:
    if why := auto_refusal(config, filter_fn):
        raise ValueError(why)
    refuse_unless_lm(model)
    if config.host_budget is not None:  # offload asked for: CUDA only, refused here at once
        check_model(model)
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
        of = "compiled_plan_of" if described.startswith("compiled-") else "plan_of"
        what = (
            "the Plan or CompiledPlan it was made from"
            if described in ("plan", "compiled-plan")
            else f"the strategy itself, slimact.apply(model, {described!r}), or its plan, "
            f"slimact.apply(model, slimact.{of}(model, {described!r}))"
        )
        raise ValueError(
            f"this Plan describes what {described!r} does, measured on one step "
            f"(slimact.strategies.describe); apply {what}"
        )
    if plan == Plan():  # the registry's default: ``apply(model, "plan")``
        raise ValueError(
            "strategy 'plan' needs a solved Plan: slimact.apply(model, Plan.load(path)) or "
            "slimact.planner.plan_for(...); the bare name carries no plan"
        )
    if plan.budget and not (plan.layers or plan.rules):  # e.g. its layers under a misspelled key
        raise ValueError(
            f"this Plan has budget {plan.budget!r} but no layers and no rules: applied, it would "
            "store every activation as it is; a plan's JSON lists its actions under 'layers' "
            "(and 'rules')"
        )
    plan.check_against(model)  # what names no module is refused before anything changes
    changes = install(model, plan=plan, filter_fn=filter_fn)
    try:  # every codec's site is one the planned model saves
        plan.check_against(model, saved_sites(model))
    except BaseException:
        run_all(*(c.undo for c in reversed(changes) if c.undo is not None))
        raise
    if not plan.layers:  # rules only (Int4Config().plan()) or nothing: no budget to check
        return changes
    return _checked(model, changes)


def saved_sites(model: nn.Module, seq: int = 8) -> set[str] | None:
    """The sites one training forward of ``model`` saves as its plan runtime has patched it
    (recomputed modules checkpointed: their inputs saved as ``checkpoint_input``, nothing inside
    them; reformulated ops saving their own), on ``seq`` random tokens with targets; the
    runtime's codec policy is taken off meanwhile (no codec runs, no codec state moves, no step
    is counted: a plan just installed has no other watcher yet), RNG and training flags are
    restored. None for a model that is not driven by token ids and targets."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    label = label_arg(model)
    hf_other = is_hf_model(model) and (
        main_input(model) != TOKEN_INPUT or is_encoder_decoder(model)
    )
    if not isinstance(vocab, int) or label is None or hf_other:
        return None
    ids, targets = random_token_batch(model, 1, seq, 0, "a plan's check")
    seen: set[str] = set()
    flags = {m: m.training for m in model.modules()}
    rt = runtime_of(model)
    policy = rt.policy if rt is not None else None
    try:
        if rt is not None:
            rt.policy = None  # (``sites.probing()`` would run recomputed modules as they are)
        model.train()
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            with sites.tracking(model), sites.listening(lambda ev: seen.add(ev.site)):
                model(ids, **{label[0]: targets})
    finally:
        if rt is not None:
            rt.policy = policy
        for m, flag in flags.items():
            m.training = flag
    return seen


register_strategy(
    "auto",
    AutoConfig(),
    apply_auto,
    "MILP planner over recompute/codecs/invact per storage under a budget (needs a budget)",
    codec_policy=True,
    compiled_form="compiled-auto",  # the compiled planner: region budgets x traced codecs
)
for _pct in ("10%", "25%", "50%"):
    register_strategy(
        f"auto@{_pct}",
        AutoConfig(budget=_pct),
        apply_auto,
        f"auto with budget {_pct}",
        codec_policy=True,
    )
register_strategy(
    "plan", Plan(), apply_plan, "apply a solved slimact.planner.Plan object", codec_policy=True
)

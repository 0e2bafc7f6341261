"""The fixed-rule strategies as plans: ``plan_of(model, "invact+int4")`` -> one ``Plan``.

A *preset* is a strategy whose effect a ``Plan`` states in full, so that applying the plan (the
one plan runtime, ``slimact.planner.apply``) does what applying the strategy does: the same
saved bytes, the same action per site and bit-identical gradients (``tests/test_presets.py``
checks each). Each config type has one handler (torchao's shape: dispatch by config type):

    none                  the empty plan: every site keeps its tensor
    cola                  the empty plan on a CoLA model (the strategy's check: the architecture
                          is CoLA, else its error) and the strategy's rows, one per CoLALinear
    recompute             every block (or those ``filter_fn`` passes) recomputed whole
    int4, int8, ...       the config's lazy rule, role -> codec (``Int4Config.plan``); with a
                          ``filter_fn``, the rule for the modules it accepts (``modules``)
    invact, invact-act    the modules the strategy would invert, as ``reform`` per block
    chunked-ce            the loss head, as ``reform`` of the root's row
    prac, pac, rac        PRAC's lazy rule (its roles -> codec labels with the ranks; with a
                          ``filter_fn``, for the modules it accepts) and its fused RMSNorms as
                          ``reform`` (``prac_plan``)
    offload               ``recompute``'s blocks, each block's input (``:checkpoint_input#0``)
                          through the codec ``offload`` (applied on CUDA only, as the strategy)
    cola-m                the CoLA blocks as ``reform`` of the whole block, kind ``cola-m`` (the
                          runtime's block reformulation: ``planner.apply.register_block_reform``)
    auto@<budget>         the plan the strategy solves on its first training batch, given as
                          ``plan_of(..., example=(input_ids, targets))`` (or on random tokens of
                          the spec's batch shape): the strategy's planner (``plan_model``) and its
                          profile cache, so the strategy, planning on that batch, takes that plan

Each handler is the strategy's planner (``strategies/parts.py``): ``recompute``, ``offload``,
``invact``, ``chunked-ce`` and ``cola-m`` find their modules with their finders (their probes
included, under ``sites.probing()``), which leave the model as it was. How they compute is the
plan's settings of their family (``Plan.settings``, ``planner.settings``): ``invact``'s other
fields than its module selection (``invact@bf16=exact-near-branch,mode=paper``),
``chunked-ce``'s (``chunked-ce@256,precompute``), and ``preserve_rng_state`` of ``recompute``,
``offload`` and ``cola-m`` (the ``recompute`` family). Refused: ``auto`` without a batch, with a
``filter_fn`` or with another part (its plan is solved for the model as it is), and the
strategies that are not presets (``compiled-*``). A ``filter_fn`` is part of the plan: blocks
and modules it rejects are left out of the layers, and each lazy rule names the modules whose
sites it may code (``SiteRule.modules``). ``offload`` offloads the first input a block's
checkpoint saves (``#0``), the block's hidden states: every input where the block is called
with one positional tensor (slimact's models, Hugging Face's decoders). A spec with ``+`` merges
its parts' plans (``Plan.merge``), which names every site where two parts conflict and every
family two parts set two ways (``invact@bf16=exact-near-branch+invact-act``).
A plan is applied in the runtime's one order (recompute, reformulate, then codecs), whatever the
order of the spec's parts.

``slimact.apply`` goes through these plans (``apply_presets``, the registry's preset path): a
spec whose every part is a preset installs ``plan_of``'s one merged plan on the one runtime,
and a later spec of presets on such a model is merged into its plan. The changes it records are
the strategies' own (``int4``'s and ``prac``'s head rows, the per-module rows with their skips:
PRAC's ranks per linear and norm module). Any other spec (one part not a preset, or a model
carrying a change that is not a preset's: a solved plan) is applied part by part, each preset's
part installed by the one part installer (``parts.install_part``, with the same rows; beside a
planner's runtime, a plan that only recomputes and reformulates is patched by the runtime's
patchers, ``planner.apply.patch_plan``). ``auto`` always takes the part-by-part
path (its lazy planning on the first batch and its re-planning budget check), shown to store
and train as its plan does.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable

import torch
import torch.nn as nn

from slimact.actions import FUSED_RMS
from slimact.classify import is_norm
from slimact.codecs.prac import resolve_rank
from slimact.hf_inputs import random_token_batch
from slimact.planner.apply import put_plan, runtime_of
from slimact.planner.auto import AutoConfig, plan_model
from slimact.planner.plan import Plan
from slimact.planner.scope import restrict_rules
from slimact.reformulate import ChunkedCEConfig, InvActConfig, fusable_rms_norms
from slimact.registry import (
    AppliedChange,
    FilterFn,
    StrategyConfig,
    register_preset_path,
    resolve,
)
from slimact.state import peek
from slimact.strategies.auto import auto_refusal, refuse_unless_lm
from slimact.strategies.chunked_ce import chunked_ce_part
from slimact.strategies.cola import CoLAConfigMarker, CoLAMConfig, cola_part, colam_part
from slimact.strategies.int4 import Int4Config, NaiveInt4Config, int4_part
from slimact.strategies.invact import invact_part
from slimact.strategies.none import NoneConfig, none_part
from slimact.strategies.offload import OffloadStrategyConfig, offload_part
from slimact.strategies.parts import (
    Part,
    finish_rows,
    is_empty,
    layers_of,
    presets_runtime,
)
from slimact.strategies.prac_config import PacConfig, PracConfig, RacConfig
from slimact.strategies.recompute import RecomputeConfig, recompute_part


def _auto(
    model: nn.Module,
    config: AutoConfig,
    filter_fn: FilterFn | None,
    example: tuple[torch.Tensor, torch.Tensor | None] | None = None,
) -> Part:
    """The plan ``auto`` solves: on ``example`` (the first training batch, which the strategy
    plans on), or with ``batch``/``seq`` on the strategy's random tokens; one profile and solve
    (``plan_model``, the strategy's planner, its profile cache included), in training mode."""
    refuse_unless_lm(model)
    if config.batch is not None:
        if example is not None:
            raise ValueError(
                f"{config.name} plans on random tokens of batch {config.batch} x seq "
                f"{config.seq}, not on an example; drop example= or the batch shape"
            )
        example = random_token_batch(model, config.batch, config.seq, config.seed, "AutoConfig")
    if example is None:
        raise ValueError(
            f"plan_of(model, {config.name!r}) needs example=(input_ids, targets): auto profiles "
            "the model on its first training batch and solves for that batch (or give the "
            "spec a batch shape, AutoConfig(batch=..., seq=...))"
        )
    ids, targets = example
    was = model.training
    model.train()
    try:
        plan = plan_model(model, config, ids, targets)
    finally:
        model.train(was)
    return plan, []


def prac_plan(model: nn.Module, config: PracConfig, filter_fn: FilterFn | None = None) -> Plan:
    """PRAC's plan: its lazy rule (``PracConfig.rule``: PRAC's roles -> codec labels carrying the
    ranks), for the modules ``filter_fn`` accepts (``SiteRule.modules``: the runtime's PRAC state
    reports the others as filtered out), and, with ``fuse_norms``, the RMSNorms ``filter_fn``
    passes reformulated to save (x, rstd) (kind ``rms-norm``)."""
    paths = fusable_rms_norms(model, filter_fn) if config.fuse_norms else []
    plan = Plan(
        layers=layers_of(model, "reform", paths, dict.fromkeys(paths, FUSED_RMS)),
        rules=(config.rule(),),
        meta=(("strategy", config.name),),
    )
    return restrict_rules(plan, model, filter_fn)


def _prac_rows(model: nn.Module, config: PracConfig, filter_fn) -> list[AppliedChange]:
    """PRAC's rows, known before the first forward: the strategy's name, ranks and clock, then
    per linear and norm module its ranks, ``filtered out`` or ``feature size too small``."""
    head = (
        f"linear ranks {config.linear}, nonlinear {config.nonlinear} (of n), "
        f"T1={config.t1} T2={config.t2}, svd={config.svd}"
    )
    rows = [AppliedChange("", config.name, head)]
    for path, m in model.named_modules():
        role = "linear" if isinstance(m, nn.Linear) else "norm" if is_norm(m) else None
        if role is None:
            continue
        if filter_fn is not None and not filter_fn(m, path):
            rows.append(AppliedChange(path, config.name, "filtered out", skipped=True))
            continue
        weight = getattr(m, "weight", None)
        n = m.in_features if role == "linear" else (None if weight is None else weight.shape[-1])
        if n is None:
            continue
        r1, r2 = config.ranks_for(role, f"{path}:?", path)
        a1, a2 = resolve_rank(r1, n), resolve_rank(r2, n)
        if n < config.min_features or a1 + a2 == 0:
            too_small = f"feature size {n} too small"
            rows.append(AppliedChange(path, config.name, too_small, skipped=True))
        else:
            rows.append(AppliedChange(path, config.name, f"{role} n={n} r1={a1} r2={a2}"))
    return rows


def prac_part(model: nn.Module, config: PracConfig, filter_fn: FilterFn | None) -> Part:
    """PRAC's preset: its plan (``prac_plan``) and rows (``_prac_rows``), refused on a model that
    carries a PRAC-family strategy already (``stateful["prac"]``: one PRAC state per model).
    The runtime's rows (fused norms, codec policy) go after the head row (``apply_presets``)."""
    st = peek(model)
    if st is not None and "prac" in st.stateful:
        rule = st.stateful["prac"].rule
        where = "every module" if rule.modules is None else ", ".join(rule.modules[:3])
        raise ValueError(
            f"a PRAC-family strategy ({st.stateful['prac'].name}) is already applied to this "
            f"model (its rule codes the sites of {where}; one PRAC state per model): "
            f"slimact.revert(model) before applying {config.name}"
        )
    return prac_plan(model, config, filter_fn), _prac_rows(model, config, filter_fn)


# a preset for plan_of; apply: the strategy (see the module docstring)
_OWN_STRATEGY = (AutoConfig,)
_CODEC_PARTS = (Int4Config, NaiveInt4Config, PracConfig)  # the runtime's rows after their head

# config type -> handler (model, config, filter_fn) -> (Plan, changes)
PRESETS: dict[type, Callable[..., Part]] = {
    NoneConfig: none_part,
    CoLAConfigMarker: cola_part,
    RecomputeConfig: recompute_part,
    Int4Config: int4_part,
    NaiveInt4Config: int4_part,
    InvActConfig: invact_part,
    ChunkedCEConfig: chunked_ce_part,
    PracConfig: prac_part,
    PacConfig: prac_part,
    RacConfig: prac_part,
    OffloadStrategyConfig: offload_part,
    CoLAMConfig: colam_part,
    AutoConfig: _auto,
}
_WITH_EXAMPLE = (AutoConfig,)  # handlers that take plan_of's example= (keyword)


def refusal(config: StrategyConfig, filter_fn: FilterFn | None) -> str:
    """Why ``config`` has no preset plan ("" where it has one)."""
    if type(config) not in PRESETS:
        return (
            f"strategy {config.name!r} has no preset plan; presets: none, recompute, offload, "
            "int4, int4-plain, int4-paper, int4-naive, int8, invact, invact-act, chunked-ce, "
            "prac, pac, rac, cola and cola-m (CoLA models), auto@<budget> (with example=) and "
            "their '+' compositions"
        )
    if isinstance(config, AutoConfig):
        return auto_refusal(config, filter_fn)
    return ""


def _parts(model: nn.Module, configs: list[StrategyConfig], filter_fn, example=None) -> list[Part]:
    return [
        PRESETS[type(c)](model, c, filter_fn, example=example)
        if isinstance(c, _WITH_EXAMPLE)
        else PRESETS[type(c)](model, c, filter_fn)
        for c in configs
    ]


def plan_and_rows(
    model: nn.Module, configs: list[StrategyConfig]
) -> tuple[Plan, list[AppliedChange]]:
    """The merged plan of the preset ``configs`` and the rows their strategies report, in spec
    order (a compiled spec's eager part: ``compiled_presets.apply_compiled_spec``); a config
    with no preset plan is a ValueError saying why (``refusal``)."""
    for config in configs:
        if why := refusal(config, None):
            raise ValueError(why)
    parts = _parts(model, configs, None)
    return functools.reduce(operator.add, [p for p, _ in parts]), [c for _, r in parts for c in r]


def plan_of(
    model: nn.Module,
    strategy: str | StrategyConfig,
    filter_fn: FilterFn | None = None,
    *,
    example: tuple[torch.Tensor, torch.Tensor | None] | None = None,
):
    """The ``Plan`` that does on ``model`` what ``strategy`` does (module docstring); a spec
    with ``+`` merges its parts' plans. The model must carry no slimact change.

    ``example``: ``(input_ids, targets)``, the first training batch, for ``auto`` (which plans
    on it); ``auto`` takes no other part (its plan is solved for the model as it is)."""
    st = peek(model)
    if st is not None and (st.applied or st.runtime is not None):
        raise ValueError("plan_of needs a model without slimact changes (slimact.revert first)")
    configs = resolve(strategy)
    for config in configs:
        if why := refusal(config, filter_fn):
            raise ValueError(why)
    if len(configs) > 1 and any(isinstance(c, AutoConfig) for c in configs):
        raise ValueError(
            f"{strategy!r}: auto's plan is solved for the whole model as it is, so plan_of takes "
            "it alone (apply the other parts' plans first, or compose the strategies)"
        )
    if example is not None and not any(isinstance(c, _WITH_EXAMPLE) for c in configs):
        raise ValueError(f"{strategy!r} plans without a batch: example= is auto's alone")
    parts = _parts(model, configs, filter_fn, example)
    for config, (plan, _) in zip(configs, parts):
        if isinstance(config, RecomputeConfig | OffloadStrategyConfig) and not plan.layers:
            raise ValueError(f"{config.name}: the model has no repeated blocks to recompute")
    return functools.reduce(operator.add, [plan for plan, _ in parts])


def apply_presets(
    model: nn.Module, configs: list[StrategyConfig], filter_fn: FilterFn | None
) -> list[AppliedChange] | None:
    """``slimact.apply`` of a spec whose every part is a preset: one merged plan (``Plan.merge``,
    which names a conflicting site) on the one plan runtime; None (nothing changed) for any
    other spec, which ``apply`` applies part by part as before (see the module docstring).

    The changes are the ones each strategy reports (``int4``'s and ``prac``'s head rows, each
    followed by the runtime's rows for it: the codec policy, PRAC's fused norms; ``recompute``'s,
    ``invact``'s and ``prac``'s per-module rows, skipped ones with their reasons), in spec order;
    the first one
    that changes something removes the runtime (``slimact.revert``). A model that carries
    earlier changes takes this path only when all of them came from presets: the new parts'
    plan is merged into its runtime's plan."""
    if any(refusal(c, filter_fn) or isinstance(c, _OWN_STRATEGY) for c in configs):
        return None
    st = peek(model)
    rt = runtime_of(model)
    if st is not None and (st.applied or rt is not None) and presets_runtime(model) is None:
        return None  # changes that are not a preset's (a solved plan, a compiled block, ...)
    parts = _parts(model, configs, filter_fn)
    new = functools.reduce(operator.add, [plan for plan, _ in parts])
    rows = [c for _, part_rows in parts for c in part_rows]
    if is_empty(new):  # nothing to change: every part skipped (or none)
        if rt is not None:
            rt.preset_rows += len(rows)
        return rows
    rt, changes, undo = put_plan(model, new, 0)
    policy = changes[-1]  # the runtime's codec-policy row, after a codec rule's head row
    fused = [c for c in changes if c.action == FUSED_RMS]  # PRAC's norms, as the runtime did them
    out: list[AppliedChange] = []
    for config, (_, part_rows) in zip(configs, parts):
        if isinstance(config, _CODEC_PARTS):
            ran = [*fused, policy] if isinstance(config, PracConfig) else [policy]
            head, *rest = part_rows
            part_rows = [head, *(AppliedChange(c.path, c.action, c.detail) for c in ran), *rest]
        out += part_rows
    return finish_rows(model, new, out, undo, rt)


register_preset_path(apply_presets)

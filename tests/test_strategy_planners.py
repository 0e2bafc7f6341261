"""Every fixed-rule strategy is a planner, ``(model, config, filter_fn) -> (Plan, rows)``: its
finder changes nothing (no patch made and undone, its probe included), and its registered
transform installs its plan on the one runtime, or, beside a planner's runtime (the
part-by-part path), patches it with the runtime's own patchers (``planner.apply.patch_plan``)."""

from __future__ import annotations

import copy

import pytest
import torch

import slimact
from slimact import checkpointing
from slimact.cola import colam
from slimact.models import build_model
from slimact.planner.apply import runtime_of
from slimact.reformulate import activations, head
from slimact.registry import applied_strategies, parts_one_by_one, resolve, transform_of
from slimact.strategies.cola import find_colam
from slimact.strategies.recompute import find_recompute

PATCHERS = [checkpointing, activations, head, colam]  # each module's own override_forward


@pytest.fixture
def patches(monkeypatch):
    """Counts every instance-forward patch the strategies' code makes (``override_forward`` as
    each patching module imported it)."""
    calls: list[str] = []
    for mod in PATCHERS:
        real = mod.override_forward

        def counted(module, *args, _real=real, _mod=mod.__name__, **kwargs):
            calls.append(f"{_mod}:{type(module).__name__}")
            return _real(module, *args, **kwargs)

        monkeypatch.setattr(mod, "override_forward", counted)
    return calls


@pytest.mark.parametrize(
    ("spec", "model_name"),
    [
        ("recompute", "llama-tiny"),
        ("offload", "llama-tiny"),
        ("invact", "llama-tiny"),
        ("invact-act", "gpt2-tiny"),
        ("chunked-ce", "llama-tiny"),
        ("chunked-ce@16,precompute", "gpt2-tiny"),
        ("invact+recompute+chunked-ce", "llama-tiny"),
        ("cola-m", "cola-tiny"),
    ],
)
def test_plan_of_patches_nothing(spec, model_name, patches):
    """``plan_of`` finds what each strategy changes (the invact consumer probe and chunked-ce's
    loss check included) without patching the model: no forward is overridden, even for a
    moment; the plan still names the modules and installs as the strategy does."""
    model = build_model(model_name)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = slimact.plan_of(model, spec)
    assert patches == [] and plan.layers
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    if spec != "offload":  # (CUDA only)
        slimact.apply(model, spec)
        assert patches  # applying does patch: the finders' silence is not the counter's
        assert runtime_of(model).plan == plan


def test_finders_report_without_changing():
    model = build_model("llama-tiny")
    rows = find_recompute(model, lambda m, p: p == "layers.1")
    assert [(c.path, c.skipped, c.detail) for c in rows] == [
        ("layers.0", True, "filtered out"),
        ("layers.1", False, ""),
    ]
    assert all(c.undo is None for c in rows)
    cola = build_model("cola-tiny")
    assert [c.path for c in find_colam(cola) if not c.skipped] == ["layers.0", "layers.1"]
    with pytest.raises(ValueError, match="'cola-m' needs a CoLA model"):
        find_colam(model)
    rows = activations.find_invact(model, activations.InvActConfig())
    assert ("layers.0.mlp.act_fn", "invact:silu") in [(c.path, c.action) for c in rows]
    assert all("forward" not in m.__dict__ for m in model.modules())


@pytest.mark.parametrize(
    ("spec", "model_name"),
    [("invact", "llama-tiny"), ("chunked-ce", "llama-tiny"), ("recompute", "gpt2-tiny")],
)
def test_a_transform_installs_its_plan_on_the_runtime(spec, model_name):
    """A strategy's registered transform, called on a model without changes, puts its plan on a
    new runtime: the reform (or recompute) rows are the modules it changes, its rows those
    ``apply`` records; ``revert`` through the row's undo leaves the model as it was."""
    base = build_model(model_name)
    plan = slimact.plan_of(base, spec)
    model = copy.deepcopy(base)
    (config,) = resolve(spec)
    rows = transform_of(config)(model, config, None)
    rt = runtime_of(model)
    assert rt is not None and rt.plan == plan and rt.preset_rows == len(rows)
    reformed = {(lp.block, p) for lp in plan.layers for p in (*lp.reform, *lp.recompute)}
    assert reformed  # the inverted modules, the chunked head, the recomputed blocks
    by_name = slimact.applied(slimact.apply(copy.deepcopy(base), spec))
    assert [(c.path, c.action, c.detail, c.skipped) for c in rows] == [
        (c.path, c.action, c.detail, c.skipped) for c in by_name
    ]
    for c in reversed(rows):
        if c.undo is not None:
            c.undo()
    assert runtime_of(model) is None
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_a_transform_part_by_part_leaves_the_runtime_to_the_planner():
    """On the part-by-part path (``parts_one_by_one``), and on a model that runs a solved plan,
    a preset's plan is patched beside the runtime: the runtime stays the planner's, and the
    rows are those the preset path records."""
    base = build_model("llama-tiny")
    model = copy.deepcopy(base)
    (config,) = resolve("invact")
    with parts_one_by_one():
        rows = transform_of(config)(model, config, None)
    assert runtime_of(model) is None and "forward" in model.layers[0].mlp.act_fn.__dict__
    by_name = slimact.applied(slimact.apply(copy.deepcopy(base), "invact"))
    assert [(c.path, c.action, c.detail) for c in rows] == [
        (c.path, c.action, c.detail) for c in by_name
    ]
    assert sum(c.undo is not None for c in rows) == 1
    next(c for c in rows if c.undo is not None).undo()
    assert all("forward" not in m.__dict__ for m in model.modules())
    solved = slimact.apply(copy.deepcopy(base), slimact.plan_of(base, "recompute"))
    plan = runtime_of(solved).plan
    slimact.apply(solved, "invact+chunked-ce")  # beside the solved plan's runtime
    assert runtime_of(solved).plan == plan and "forward" in solved.lm_head.__dict__
    slimact.revert(solved)
    assert all("forward" not in m.__dict__ for m in solved.modules())


def test_invact_then_auto_plans_on_the_inverted_model():
    """``invact+auto``: invact is patched beside auto's runtime, which plans lazily on the first
    training batch, on the model with the inverted modules (its profile sees them)."""
    torch.manual_seed(0)
    spec = "invact+auto@25%,cache=none,repeats=1,codecs=int8"
    model = slimact.apply(build_model("llama-tiny"), spec)
    assert applied_strategies(model) == ["invact", "auto@25%,cache=none,repeats=1,codecs=int8"]
    rt = runtime_of(model)
    assert rt is not None and rt.plan is None and rt.preset_rows is None
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    model(ids, targets=ids).loss.backward()
    assert rt.plan is not None and "forward" in model.layers[0].mlp.act_fn.__dict__
    assert all("mlp.act_fn" not in lp.reform for lp in rt.plan.layers)  # inverted already
    slimact.revert(model)
    assert runtime_of(model) is None
    assert all("forward" not in m.__dict__ for m in model.modules())

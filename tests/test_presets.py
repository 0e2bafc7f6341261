"""The fixed-rule strategies as plans (``slimact.plan_of``): applying ``plan_of(model, name)``
does what applying ``name`` does, with the same saved bytes, the same action per site and
bit-identical gradients, alone and composed with ``+``; PRAC's over several steps, its state
checkpointed and resumed."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

import slimact
from slimact.budget import BudgetWarning
from slimact.codecs.offload import using_streams
from slimact.models import build_model
from slimact.patching import overrides
from slimact.planner.apply import runtime_of
from slimact.planner.plan import Plan
from slimact.planner.settings import ChunkedCESettings, InvActSettings, RecomputeSettings
from slimact.registry import applied_strategies, resolve, transform_of
from slimact.sites import block_paths
from slimact.state import state_of
from slimact.strategies.cola import CoLAMConfig
from slimact.strategies.offload import OffloadStrategyConfig
from slimact.strategies.prac import PracConfig, prac_report
from slimact.strategies.recompute import RecomputeConfig

PRESETS = [
    "none",
    "recompute",
    "invact",
    "invact-act",
    "chunked-ce",
    "int4",
    "int8",
    "int4-plain",
    "int4-paper",
    "int4-naive",
    "int4@sr",
    "invact+int4",
    "recompute+int4",
    "invact+recompute+chunked-ce",
    "invact+int4+chunked-ce",
    "int4+chunked-ce",
    "invact@mode=paper,variant=lsb",
    "chunked-ce@16,precompute",
    "invact-act@variant=lsb+chunked-ce@16+int4",
]


def _step(model, ids):
    with slimact.measure(model) as m:
        loss = model(ids, targets=ids).loss
    loss.backward()
    return loss.detach(), m.report


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _same_step(a, b, ids, seed: int | None = None) -> None:
    """One training step of ``a`` and of ``b`` on ``ids``: the same loss, saved bytes, action per
    site and gradients, bit for bit (the same parameters with and without a gradient). With a
    ``seed``, each step starts from it (models with dropout)."""
    for m in (a, b):
        m.zero_grad(set_to_none=True)
    steps = []
    for m in (a, b):
        if seed is not None:
            torch.manual_seed(seed)
        steps.append(_step(m, ids))
    (loss_a, rep_a), (loss_b, rep_b) = steps
    assert torch.equal(loss_a, loss_b)
    assert rep_a.total_bytes == rep_b.total_bytes
    assert {s.site: s.action for s in rep_a.sites} == {s.site: s.action for s in rep_b.sites}
    grads_a, grads_b = _grads(a), _grads(b)
    assert grads_a.keys() == grads_b.keys()
    assert all(torch.equal(g, grads_b[k]) for k, g in grads_a.items())


@pytest.mark.parametrize("model_name", ["llama-tiny", "gpt2-tiny"])
@pytest.mark.parametrize("name", PRESETS)
def test_a_preset_plan_applies_like_its_strategy(name, model_name):
    torch.manual_seed(0)
    base = build_model(model_name)
    plan = slimact.plan_of(base, name)
    assert isinstance(plan, Plan) and slimact.applied(base) == []  # the model is left as it was
    ids = torch.randint(
        0, base.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0)
    )
    by_name, by_plan = (slimact.apply(copy.deepcopy(base), s) for s in (name, plan))
    assert runtime_of(by_plan).plan == plan
    # the strategy applies through the same plan on the one runtime (none: no runtime at all)
    assert (runtime_of(by_name) is None) if name == "none" else runtime_of(by_name).plan == plan
    for _ in range(2):  # the second step runs the codecs' deferred encodes
        _same_step(by_name, by_plan, ids)


def _own(model, spec):
    """``spec`` applied part by part (not the preset path): each part as ``apply``'s part path
    runs it (``transform_of``: a preset's part installed, or a strategy's own transform)."""
    for config in resolve(spec):
        transform_of(config)(model, config, None)
    return model


# (spec or config, model, model options, the default it must differ from: its settings matter)
SETTINGS = [
    ("invact@mode=paper,variant=lsb", "llama-tiny", {}, "invact"),
    ("invact@bf16=exact-near-branch", "gpt2-tiny", {"dtype": torch.bfloat16}, "invact"),
    ("chunked-ce@16,precompute", "llama-tiny", {}, "chunked-ce"),
    (RecomputeConfig(preserve_rng_state=False), "gpt2-tiny", {"dropout": 0.1}, "recompute"),
    (OffloadStrategyConfig(preserve_rng_state=False), "gpt2-tiny", {"dropout": 0.1}, "offload"),
    (CoLAMConfig(preserve_rng_state=False), "cola-tiny", {}, None),  # no dropout: as the default
]


@pytest.mark.parametrize(("spec", "model_name", "options", "default"), SETTINGS)
def test_a_preset_with_settings_is_the_strategys_own_transform(
    spec, model_name, options, default, fake_streams
):
    """A config with other settings than the runtime's defaults (``invact``'s, ``chunked-ce``'s,
    ``preserve_rng_state=False``) is a preset: its plan states them (``Plan.settings``), and
    ``apply(spec)`` (the preset path), ``apply(plan_of(spec))`` and the strategy's own transform
    store the same bytes per site and give bit-identical gradients, also with dropout drawn
    again in the recomputation; the settings matter (the default differs) where they can."""
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with using_streams(fake_streams):
        torch.manual_seed(0)
        base = build_model(model_name, **options)
        plan = slimact.plan_of(base, spec)
        assert plan.settings and Plan.from_dict(json.loads(plan.to_json())) == plan
        own = _own(copy.deepcopy(base), spec)
        by_name, by_plan = (slimact.apply(copy.deepcopy(base), s) for s in (spec, plan))
        assert runtime_of(by_name).preset_rows and runtime_of(by_name).plan == plan
        for _ in range(2):
            _same_step(own, by_name, ids, seed=1)
            _same_step(by_name, by_plan, ids, seed=1)
        if not plan.setting("recompute").preserve_rng_state:  # the runtime's checkpoints
            blocks = [by_plan.get_submodule(p) for p in block_paths(by_plan)]
            assert all(o.args[-1] is False for b in blocks for o in overrides(b))
        if default is not None:
            other = slimact.apply(copy.deepcopy(base), default)
            with pytest.raises(AssertionError):
                _same_step(by_plan, other, ids, seed=1)


def test_settings_are_stated_saved_and_merged():
    """``Plan.settings``: the non-default settings of each family, JSON as ``{_type, _data}``;
    a plan saved without them (or without a field) loads with the defaults; two parts that set
    one family two ways are refused, naming it."""
    model = build_model("llama-tiny")
    plan = slimact.plan_of(model, "invact@bf16=exact-near-branch+chunked-ce@256+int4")
    assert plan.setting("invact") == InvActSettings(bf16="exact-near-branch")
    assert plan.setting("chunked-ce") == ChunkedCESettings(chunk_size=256)
    assert plan.setting("recompute") == RecomputeSettings()  # not stated: the default
    saved = json.loads(plan.to_json())
    assert saved["settings"]["invact"] == {
        "_type": "InvActSettings",
        "_data": dataclasses.asdict(InvActSettings(bf16="exact-near-branch")),
    }
    assert Plan.from_dict(saved) == plan
    assert "== settings of invact: bf16='exact-near-branch'" in plan.table()
    saved["settings"]["invact"]["_data"] = {"bf16": "exact-near-branch"}  # older: fields absent
    assert Plan.from_dict(saved) == plan
    old = json.loads(slimact.plan_of(model, "recompute+invact").to_json())
    del old["settings"]  # a plan saved before settings: every family's defaults
    assert Plan.from_dict(old).settings == () and Plan.from_dict(old).uses("recompute")
    assert Plan.from_dict(old).setting("recompute").preserve_rng_state is True
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['tile'\]"):
        Plan.from_dict({"settings": {"invact": {"_type": "InvActSettings", "_data": {"tile": 1}}}})
    with pytest.raises(ValueError, match="bf16 must be one of"):
        InvActSettings(bf16="fast")  # validated as InvActConfig is
    assert Plan(settings={"invact": InvActSettings()}) == Plan()  # defaults are not stated
    # merging: one setting per family both plans act with
    exact = slimact.plan_of(model, "invact@bf16=exact-near-branch")
    with pytest.raises(ValueError, match="set invact two ways: bf16='exact-near-branch' in invact"):
        exact + slimact.plan_of(model, "invact-act")
    with pytest.raises(ValueError, match="set chunked-ce two ways: chunk_size=256 in chunked-ce"):
        slimact.plan_of(model, "chunked-ce@256") + slimact.plan_of(model, "chunked-ce")
    no_rng = slimact.plan_of(model, RecomputeConfig(preserve_rng_state=False))
    with pytest.raises(ValueError, match="set recompute two ways: preserve_rng_state=False"):
        no_rng + slimact.plan_of(model, "offload")
    lsb = slimact.apply(copy.deepcopy(model), "invact-act@variant=lsb")
    with pytest.raises(ValueError, match="the plans set invact two ways"):
        slimact.apply(lsb, "invact")  # merged into its runtime's plan: refused, the plan kept
    assert runtime_of(lsb).plan == slimact.plan_of(model, "invact-act@variant=lsb")
    merged = no_rng + slimact.plan_of(model, "invact@mode=paper+int8")  # other families: kept
    assert dict(merged.settings) == {
        "invact": InvActSettings(mode="paper"),
        "recompute": RecomputeSettings(preserve_rng_state=False),
    }
    assert Plan.from_dict(json.loads(merged.to_json())) == merged


PRAC_PRESETS = [
    *((name, model) for name in ("prac", "pac", "rac") for model in ("llama-tiny", "gpt2-tiny")),
    ("prac@t1=2,svd=exact", "llama-tiny"),
    ("prac@q2=store,fuse_norms=false", "llama-tiny"),
    ("invact+prac", "llama-tiny"),
    ("invact+prac", "gpt2-tiny"),
    ("recompute+prac", "llama-tiny"),
]


@pytest.mark.parametrize(("name", "model_name"), PRAC_PRESETS)
def test_a_prac_preset_applies_like_its_strategy_and_resumes(name, model_name):
    """PRAC draws random subspaces on a step clock: over several steps (Q1 and Q2 updates), the
    preset's plan stores the same bytes, per site, and gives bit-identical gradients; its state
    (``stateful["prac"]``, the runtime's per-storage codecs) checkpoints and resumes alike. At
    4 x 128 tokens PRAC compresses the linear inputs of both tiny models (``prac_report``)."""
    torch.manual_seed(0)
    base = build_model(model_name)
    plan = slimact.plan_of(base, name)
    assert slimact.applied(base) == [] and Plan.from_dict(plan.to_dict()) == plan
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, base.config.vocab_size, (4, 128), generator=gen) for _ in range(4)]
    by_name, by_plan = (slimact.apply(copy.deepcopy(base), s) for s in (name, plan))
    assert runtime_of(by_plan).plan == plan
    saved = None
    for i, ids in enumerate(batches):
        if i == 2:  # a checkpoint of the plan's state, resumed by a fresh copy below
            saved = copy.deepcopy(
                {k: v.state_dict() for k, v in state_of(by_plan).stateful.items()}
            )
        _same_step(by_name, by_plan, ids)
    report = prac_report(by_plan)
    assert report == prac_report(by_name) and report["forwards"] == 4
    linear = [c for c in report["compressed"].values() if c["role"] in ("linear", "output")]
    assert linear and all(c["updates"]["q2"] >= 1 for c in linear)
    resumed = slimact.apply(copy.deepcopy(base), plan)
    for k, sd in saved.items():
        state_of(resumed).stateful[k].load_state_dict(sd)
    for ids in batches[2:]:
        resumed.zero_grad(set_to_none=True)
        _step(resumed, ids)
    for m in (resumed, by_plan):
        m.zero_grad(set_to_none=True)
        _step(m, batches[0])
    grads = _grads(by_plan)
    assert all(torch.equal(g, grads[k]) for k, g in _grads(resumed).items())
    ranks = [
        {k: c["ranks"] for k, c in prac_report(m)["compressed"].items()} for m in (resumed, by_plan)
    ]
    assert ranks[0] == ranks[1]


def test_a_prac_plan_names_its_ranks():
    model = build_model("llama-tiny")
    plan = slimact.plan_of(model, "prac")
    (rule,) = plan.rules
    assert rule.roles == "prac" and dict(rule.codecs)["linear"] == "prac/r1=0.3,r2=0.3"
    table = plan.table()
    assert "codec:prac/r1=0.3,r2=0.3" in table and "codec:prac/r1=0.2,r2=0.2" in table
    assert "codec:pac/r1=0.6,r2=0" in slimact.plan_of(model, "pac").table()
    assert plan.site_actions()["layers.0.input_layernorm:"] == "reformulate:rms_norm"
    overridden = slimact.plan_of(
        model, PracConfig(overrides=(("*down_proj*", 4, 4),), keep=("*lm_head*",))
    )
    assert "ranks r1=4, r2=4 (override)" in overridden.table()
    assert Plan.from_dict(json.loads(overridden.to_json())) == overridden
    acts = slimact.plan_of(model, "invact+prac").site_actions()
    assert acts["layers.0.input_layernorm:"] == "reformulate:inv_rms_norm"  # invact's stays


def test_plans_say_what_each_preset_does():
    model = build_model("llama-tiny")
    assert slimact.plan_of(model, "none").site_actions() == {}
    assert slimact.plan_of(model, "recompute").site_actions() == {
        "layers.0:": "recompute",
        "layers.1:": "recompute",
    }
    acts = slimact.plan_of(model, "invact+chunked-ce").site_actions()
    assert acts["layers.1.mlp.act_fn:"] == "reformulate:inv_silu"
    assert acts["norm:"] == "reformulate:inv_rms_norm" and acts["lm_head:"] == (
        "reformulate:chunked_ce"
    )
    assert set(slimact.plan_of(model, "invact-act").site_actions()) == {
        "layers.0.mlp.act_fn:",
        "layers.1.mlp.act_fn:",
    }
    (rule,) = slimact.plan_of(model, "int4").rules
    assert dict(rule.codecs)["act"] == "int4-outlier-g16"
    only_first = slimact.plan_of(model, "recompute", filter_fn=lambda m, p: p == "layers.0")
    assert only_first.site_actions() == {"layers.0:": "recompute"}


def test_what_has_no_preset_is_refused_by_name():
    model = build_model("llama-tiny")
    with pytest.raises(ValueError, match="'compiled-int4' has no preset plan; presets: none"):
        slimact.plan_of(model, "compiled-int4")
    with pytest.raises(ValueError, match="'cola-m' needs a CoLA model"):
        slimact.plan_of(model, "cola-m")  # the strategy's own refusal
    with pytest.raises(ValueError, match="strategy 'cola' needs a CoLA model"):
        slimact.plan_of(model, "cola")  # cola's: the model is not CoLA
    with pytest.raises(ValueError, match="'cola' needs a CoLA model"):
        slimact.apply(model, "cola+int4")
    assert slimact.applied(model) == [] and runtime_of(model) is None
    with pytest.raises(ValueError, match="unknown strategy 'int3'"):
        slimact.plan_of(model, "int3")
    slimact.apply(model, "recompute")
    with pytest.raises(ValueError, match="without slimact changes"):
        slimact.plan_of(model, "int4")


def test_a_conflicting_composition_names_the_site():
    """``+`` of presets is ``Plan.merge``: two codec rules for one role are refused by role."""
    model = build_model("llama-tiny")
    with pytest.raises(ValueError, match="act"):
        slimact.plan_of(model, "int4") + slimact.plan_of(model, "int8")


def test_a_probe_is_not_a_step():
    """``invact`` and ``chunked-ce`` probe the model on a dummy batch. Applied after a plan, that
    probe used to run through the plan's codecs (their state moved: ``int4+chunked-ce`` stored
    other bytes than ``chunked-ce+int4``) and was taken for the first step, whose budget check
    then judged the dummy batch, leaving the real first step unchecked."""
    model = build_model("llama-tiny")
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    tiny = Plan(
        budget="1KiB",
        budget_bytes=1024,
        layers=slimact.plan_of(model, "recompute").layers,
    )
    slimact.apply(model, tiny)
    slimact.apply(model, "invact+chunked-ce")  # both probe, after the plan's hooks
    with pytest.warns(BudgetWarning, match="the first step stored"):
        model(ids, targets=ids).loss.backward()
    totals = []
    for spec in ("int4+chunked-ce", "chunked-ce+int4"):
        torch.manual_seed(0)
        m = slimact.apply(build_model("llama-tiny"), spec)
        with slimact.measure(m) as meter:
            m(ids, targets=ids).loss.backward()
        totals.append(meter.report.total_bytes)
    assert totals[0] == totals[1]


def test_a_spec_of_presets_installs_one_plan():
    """``apply(m, "invact+recompute+int4")`` is one merged plan on one runtime; the changes are
    still each strategy's rows, and ``revert`` undoes them all."""
    model = build_model("llama-tiny")
    slimact.apply(model, "invact+recompute+int4")
    rt = runtime_of(model)
    assert rt.plan == slimact.plan_of(build_model("llama-tiny"), "invact+recompute+int4")
    rows = [(c.path, c.action) for c in slimact.applied(model) if not c.skipped]
    assert ("layers.1.mlp.act_fn", "invact:silu") in rows and ("layers.0", "recompute") in rows
    assert ("", "int4") in rows and ("", "codec-policy") in rows
    assert sum(c.undo is not None for c in slimact.applied(model)) == 1  # the runtime's removal
    slimact.revert(model)
    assert runtime_of(model) is None and slimact.applied(model) == []
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_presets_applied_one_after_another_merge_into_one_plan():
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    base = build_model("llama-tiny")
    once = slimact.apply(copy.deepcopy(base), "invact+recompute+int4")
    twice = slimact.apply(copy.deepcopy(base), "invact")
    slimact.apply(twice, "recompute+int4")
    assert applied_strategies(twice) == ["invact", "recompute", "int4"]
    assert runtime_of(twice).plan.site_actions() == runtime_of(once).plan.site_actions()
    (_, a), (_, b) = _step(once, ids), _step(twice, ids)
    assert a.total_bytes == b.total_bytes
    for p, q in zip(once.parameters(), twice.parameters()):
        assert torch.equal(p.grad, q.grad)
    slimact.revert(twice)
    assert runtime_of(twice) is None and all("forward" not in m.__dict__ for m in twice.modules())


def test_what_is_not_all_presets_applies_part_by_part():
    """A spec on a model carrying a change that is not a preset's (a solved plan) applies its
    parts one after another, as the strategies do; ``prac``, ``invact+prac``, a ``filter_fn`` on
    a codec rule and ``cola`` are presets."""
    model = build_model("llama-tiny")
    slimact.apply(model, slimact.plan_of(build_model("llama-tiny"), "int4"))
    slimact.apply(model, "invact")
    # invact patched by its own transform; the runtime is the plan's (its rule alone)
    assert "forward" in model.layers[0].mlp.act_fn.__dict__
    assert runtime_of(model).preset_rows is None
    assert not any(lp.reform for lp in runtime_of(model).plan.layers)
    model = slimact.apply(build_model("llama-tiny"), "invact+prac")
    assert runtime_of(model).plan == slimact.plan_of(build_model("llama-tiny"), "invact+prac")
    assert runtime_of(model).preset_rows == len(slimact.applied(model))  # one preset plan
    model = slimact.apply(build_model("llama-tiny"), "recompute")
    slimact.apply(model, "int4", lambda m, p: p.startswith("layers.0"))  # joins its plan
    assert applied_strategies(model) == ["recompute", "int4"]
    assert runtime_of(model).plan.rules[0].modules[0] == "layers.0"  # the filter_fn, in the plan
    cola = slimact.apply(build_model("cola-tiny"), "recompute")
    slimact.apply(cola, "int4+cola")  # presets: int4's rule joins recompute's plan
    assert applied_strategies(cola) == ["recompute", "int4", "cola"]
    assert runtime_of(cola).preset_rows == len(slimact.applied(cola))
    one = slimact.plan_of(build_model("cola-tiny"), "recompute+int4")
    assert (runtime_of(cola).plan.layers, runtime_of(cola).plan.rules) == (one.layers, one.rules)
    assert sum(c.action == "cola" for c in slimact.applied(cola)) == 14  # one per CoLALinear


def test_prac_after_a_preset_joins_its_plan_and_reverts():
    """``apply(m, "recompute")`` installs a preset's runtime; ``apply(m, "prac")`` after it merges
    PRAC's plan into that runtime (one runtime), trains like ``prac+recompute`` in one call, and
    ``slimact.revert`` takes the model back to its original modules."""
    torch.manual_seed(0)
    base = build_model("llama-tiny")
    ids = torch.randint(0, 256, (4, 128), generator=torch.Generator().manual_seed(0))
    seq = slimact.apply(slimact.apply(copy.deepcopy(base), "recompute"), "prac")
    one = slimact.apply(copy.deepcopy(base), "prac+recompute")
    assert [r.roles for r in runtime_of(seq).plan.rules] == ["prac"]
    assert runtime_of(seq).plan.layer("layers.0").recompute == ("",)
    for _ in range(2):
        (la, ra), (lb, rb) = _step(seq, ids), _step(one, ids)
        assert torch.equal(la, lb) and ra.total_bytes == rb.total_bytes
        for (name, p), q in zip(seq.named_parameters(), one.parameters()):
            assert torch.equal(p.grad, q.grad), name
        for m in (seq, one):
            m.zero_grad(set_to_none=True)
    slimact.revert(seq)
    assert runtime_of(seq) is None and slimact.applied(seq) == []
    assert "forward" not in seq.layers[0].__dict__ and "prac" not in state_of(seq).stateful


# -- offload (CUDA streams stubbed) and the CoLA presets -----------------------------------

OWN_TRANSFORM = [
    ("offload", "llama-tiny"),
    ("offload", "gpt2-tiny"),
    ("invact+offload", "llama-tiny"),
    ("offload+chunked-ce", "gpt2-tiny"),
    ("cola-m", "cola-tiny"),
    ("invact+cola-m", "cola-tiny"),
    ("cola-m+int8", "cola-tiny"),
    ("cola", "cola-tiny"),
    ("cola+int4", "cola-tiny"),
    ("cola+cola-m", "cola-tiny"),
]


@pytest.mark.parametrize(("name", "model_name"), OWN_TRANSFORM)
def test_offload_and_colam_plans_apply_like_their_strategies(name, model_name, fake_streams):
    """``offload`` (CPU: the CUDA streams stubbed) and ``cola-m`` (a block reformulation of the
    plan runtime) as plans: the same bytes, host bytes, action per site and gradients as the
    strategies' own transforms, alone and composed."""
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with using_streams(fake_streams):
        torch.manual_seed(0)
        base = build_model(model_name)
        plan = slimact.plan_of(base, name)
        assert slimact.applied(base) == [] and Plan.from_dict(plan.to_dict()) == plan
        by_name, by_plan = (slimact.apply(copy.deepcopy(base), s) for s in (name, plan))
        assert runtime_of(by_plan).plan == plan
        for _ in range(2):
            _same_step(by_name, by_plan, ids)
        host = []
        for m in (by_name, by_plan):
            with slimact.measure(m) as meter:
                m(ids, targets=ids).loss.backward()
            host.append(meter.report.host_bytes)
    assert host[0] == host[1] and (host[0] > 0) == ("offload" in name)
    slimact.revert(by_plan)
    assert runtime_of(by_plan) is None and all(
        "forward" not in m.__dict__ for m in by_plan.modules()
    )


def test_offload_and_colam_plans_say_what_they_do():
    model = build_model("llama-tiny")
    assert slimact.plan_of(model, "offload").site_actions() == {
        "layers.0:": "recompute",
        "layers.0:checkpoint_input#0": "offload",
        "layers.1:": "recompute",
        "layers.1:checkpoint_input#0": "offload",
    }
    first = slimact.plan_of(model, "offload", filter_fn=lambda m, p: p == "layers.0")
    assert set(first.site_actions()) == {"layers.0:", "layers.0:checkpoint_input#0"}
    with pytest.raises(ValueError, match="in host memory already"):
        slimact.apply(build_model("llama-tiny"), slimact.plan_of(model, "offload"))
    with_int8 = slimact.plan_of(model, "offload+int8")  # the block inputs offloaded, the rest int8
    assert with_int8.site_actions() == slimact.plan_of(model, "offload").site_actions()
    assert with_int8.rules == slimact.plan_of(model, "int8").rules
    no_rng = slimact.plan_of(model, OffloadStrategyConfig(preserve_rng_state=False))
    assert no_rng.settings == (("recompute", RecomputeSettings(preserve_rng_state=False)),)
    assert no_rng.site_actions() == slimact.plan_of(model, "offload").site_actions()
    cola = build_model("cola-tiny")
    plan = slimact.plan_of(cola, "cola-m")
    assert plan.site_actions() == {
        "layers.0:": "reformulate:cola_m",
        "layers.1:": "reformulate:cola_m",
    }
    assert "(whole block): reformulate:cola_m" in plan.table()
    no_rng = slimact.plan_of(cola, CoLAMConfig(preserve_rng_state=False))
    assert no_rng.settings == (("recompute", RecomputeSettings(preserve_rng_state=False)),)
    assert plan.settings == () and no_rng.layers == plan.layers
    with pytest.raises(ValueError, match="layers.0 is recomputed in one plan and reformulated"):
        slimact.plan_of(cola, "recompute+cola-m")
    # a block the runtime cannot switch to CoLA-M: refused, the model left as it was
    llama = build_model("llama-tiny")
    with pytest.raises(ValueError, match="plan reformulates 'layers.0' as cola-m: not a CoLA"):
        slimact.apply(llama, plan)
    assert slimact.applied(llama) == [] and all(
        "forward" not in m.__dict__ for m in llama.modules()
    )


def _auto_spec(tmp_path) -> str:
    """A quick auto (two candidate codecs, one plan for all blocks, no error caps; which actions
    it takes depends on the measured times), its profile cached in ``tmp_path``."""
    return (
        f"auto@10%,cache={tmp_path},repeats=1,layers=uniform,codecs=int8-asym/int8-channel,"
        "max_rel_err=none,max_grad_err=none"
    )


def test_an_auto_plan_applies_like_the_strategy(tmp_path):
    """``plan_of(m, "auto@25%", example=(ids, targets))`` profiles and solves on that batch
    through the strategy's planner and profile cache: the strategy, planning lazily on the same
    first batch, installs the same plan, and both train alike."""
    torch.manual_seed(0)
    base = build_model("llama-tiny")
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    spec = _auto_spec(tmp_path)
    plan = slimact.plan_of(base, spec, example=(ids, ids))
    assert isinstance(plan, Plan) and plan.layers and slimact.applied(base) == []
    assert plan.budget == "10%" and (plan.batch, plan.seq) == (2, 32)
    assert set(plan.site_actions().values()) - {"keep"}  # 10% of the baseline: some change
    by_name, by_plan = (slimact.apply(copy.deepcopy(base), s) for s in (spec, plan))
    assert runtime_of(by_name).plan is None  # lazy: plans on the first training forward
    for _ in range(2):
        _same_step(by_name, by_plan, ids)

    def solved(p: Plan) -> Plan:  # the solver's wall time is the one field that may differ
        return dataclasses.replace(p, solve_s=0.0)

    assert solved(runtime_of(by_name).plan) == solved(plan) == solved(runtime_of(by_plan).plan)


def test_an_auto_plan_needs_its_batch(tmp_path):
    model = build_model("llama-tiny")
    with pytest.raises(ValueError, match=r"needs example=\(input_ids, targets\)"):
        slimact.plan_of(model, "auto@25%")
    with pytest.raises(ValueError, match="'auto' needs a memory budget"):
        slimact.plan_of(model, "auto")
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="plan_of takes it alone"):
        slimact.plan_of(model, "invact+auto@25%", example=(ids, ids))
    with pytest.raises(ValueError, match="example= is auto's alone"):
        slimact.plan_of(model, "int4", example=(ids, ids))
    with pytest.raises(ValueError, match="filter_fn is not supported"):
        slimact.plan_of(model, "auto@25%", lambda m, p: True, example=(ids, ids))
    # a spec with a batch shape plans on the strategy's random tokens, as the strategy does
    shaped = slimact.planner.auto.AutoConfig.from_spec(_auto_spec(tmp_path), batch=2, seq=32)
    plan = slimact.plan_of(model, shaped)
    applied = slimact.apply(copy.deepcopy(model), shaped)
    assert runtime_of(applied).plan.site_actions() == plan.site_actions()
    with pytest.raises(ValueError, match="drop example= or the batch shape"):
        slimact.plan_of(model, shaped, example=(ids, ids))

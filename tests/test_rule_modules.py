"""A ``filter_fn`` is part of the plan: each lazy rule names the modules whose sites it may code
(``SiteRule.modules``), so ``plan_of(model, spec, filter_fn)`` states in full what
``apply(model, spec, filter_fn)`` does, and the PRAC family installs through the preset path
(one plan on the one runtime) with the rows its strategy reports."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import slimact
from slimact.models import build_model
from slimact.planner.apply import runtime_of
from slimact.planner.plan import Plan, SiteRule
from slimact.registry import parts_one_by_one, resolve, transform_of
from slimact.state import state_of
from slimact.strategies.prac import PracConfig, prac_report


def first_block(module, path: str) -> bool:
    """Everything but the second block (``layers.1`` / ``h.1``) and what is inside it."""
    return not path.startswith(("layers.1", "h.1"))


FILTERED = [
    ("int4", "llama-tiny"),
    ("int4-naive", "gpt2-tiny"),
    ("recompute+int8", "llama-tiny"),
    ("prac", "llama-tiny"),
    ("pac", "gpt2-tiny"),
    ("invact+prac", "llama-tiny"),
]
PRAC_HEAD = "linear ranks (0.3, 0.3), nonlinear (0.2, 0.2) (of n), T1=5 T2=1, svd=randomized"
FUSED = "RMSNorm saves (x, rstd), not (x, x\u0302)"
NORM, LINEAR = "norm n=64 r1=12 r2=12", "linear n=64 r1=19 r2=19"
LLAMA_BLOCK = [  # (module, what prac reports) of one llama-tiny block, in module order
    ("input_layernorm", NORM),
    *((f"self_attn.{p}_proj", LINEAR) for p in "qkvo"),
    ("post_attention_layernorm", NORM),
    ("mlp.gate_proj", LINEAR),
    ("mlp.up_proj", LINEAR),
    ("mlp.down_proj", "linear n=172 r1=51 r2=51"),
]


def _same_steps(models, ids) -> list:
    """One training step of each model on ``ids``: the same loss, saved bytes, action per site
    and gradients, bit for bit, as the first model's; returns the first one's report."""
    out = []
    for m in models:
        m.zero_grad(set_to_none=True)
        with slimact.measure(m) as meter:
            loss = m(ids, targets=ids).loss
        loss.backward()
        grads = {n: p.grad for n, p in m.named_parameters() if p.grad is not None}
        out.append((loss.detach(), meter.report, grads))
    loss, report, grads = out[0]
    for other_loss, other, other_grads in out[1:]:
        assert torch.equal(loss, other_loss) and report.total_bytes == other.total_bytes
        assert {s.site: s.action for s in report.sites} == {s.site: s.action for s in other.sites}
        assert grads.keys() == other_grads.keys()
        assert all(torch.equal(g, other_grads[k]) for k, g in grads.items())
    return report


@pytest.mark.parametrize(("name", "model_name"), FILTERED)
def test_a_filter_fn_is_part_of_the_plan(name, model_name):
    """``apply(m, name, filter_fn=f)`` and ``apply(m, plan_of(m, name, f))`` (and, for a codec
    strategy alone, its own transform) store the same bytes, per site, and give bit-identical
    gradients over two steps; the rule codes nothing in the block ``f`` rejects."""
    torch.manual_seed(0)
    base = build_model(model_name)
    plan = slimact.plan_of(base, name, first_block)
    assert slimact.applied(base) == []
    (rule,) = plan.rules
    assert rule.modules and not any(p.startswith(("layers.1", "h.1")) for p in rule.modules)
    assert Plan.from_dict(json.loads(plan.to_json())) == plan
    models = [slimact.apply(copy.deepcopy(base), s, first_block) for s in (name, plan)]
    assert runtime_of(models[0]).plan == plan == runtime_of(models[1]).plan
    (config, *rest) = resolve(name)
    if not rest:  # the strategy's own transform (a spec with a part that is no preset)
        own = copy.deepcopy(base)
        with parts_one_by_one():
            transform_of(config)(own, config, first_block)
        assert runtime_of(own).plan == plan and runtime_of(own).preset_rows is None
        models.append(own)
    gen = torch.Generator().manual_seed(0)
    shape = (4, 128) if "ac" in name else (2, 32)  # PRAC pays off from ~n tokens per batch
    for _ in range(2):  # PRAC: Q1/Q2 updates; the int codecs' deferred encodes
        ids = torch.randint(0, base.config.vocab_size, shape, generator=gen)
        report = _same_steps(models, ids)
    coded = {s.site for s in report.sites if s.action.startswith("codec:")}
    assert coded and not any(s.startswith(("layers.1", "h.1")) for s in coded)


def _rows(model) -> list[tuple[str, str, str, bool]]:
    return [(c.path, c.action, c.detail, c.skipped) for c in slimact.applied(model)]


def test_prac_reports_its_rows_on_the_preset_path():
    """The rows the strategy reported before it was a preset: its head row (the one undo, the
    runtime's removal), the norms the runtime fused, the codec policy, then per linear and norm
    module its ranks, ``filtered out`` or ``feature size too small``."""
    model = slimact.apply(build_model("llama-tiny"), "prac", first_block)
    rule = runtime_of(model).plan.rules[0]
    assert rule.describe().endswith("; in 19 module(s)")  # every module but layers.1's
    fused = ["layers.0.input_layernorm", "layers.0.post_attention_layernorm", "norm"]
    assert _rows(model) == [
        ("", "prac", PRAC_HEAD, False),
        *((path, "rms-norm", FUSED, False) for path in fused),
        ("", "codec-policy", f"0 site(s) through codecs; rule {rule.describe()}", False),
        *((f"layers.0.{path}", "prac", what, False) for path, what in LLAMA_BLOCK),
        *((f"layers.1.{path}", "prac", "filtered out", True) for path, _ in LLAMA_BLOCK),
        ("norm", "prac", NORM, False),
        ("lm_head", "prac", LINEAR, False),
    ]
    undos = [c.undo is not None for c in slimact.applied(model)]
    assert undos == [True] + [False] * 24 and runtime_of(model).preset_rows == 25
    slimact.revert(model)
    assert runtime_of(model) is None and "prac" not in state_of(model).stateful
    assert all("forward" not in m.__dict__ for m in model.modules())
    small = _rows(slimact.apply(build_model("llama-tiny"), "prac@fuse_norms=false,t1=2"))
    assert ("layers.0.self_attn.q_proj", "prac", LINEAR, False) in small
    assert not any(action == "rms-norm" for _, action, _, _ in small)
    model = slimact.apply(build_model("llama-tiny"), PracConfig(min_features=100))
    assert ("layers.0.mlp.down_proj", "prac", "linear n=172 r1=51 r2=51", False) in _rows(model)
    assert ("lm_head", "prac", "feature size 64 too small", True) in _rows(model)


def test_invact_and_prac_are_one_plan_with_both_strategies_rows():
    """``invact+prac``: invact's rows (its inverted norms, no fused ones), then PRAC's; one
    runtime, whose plan is ``plan_of``'s, and one undo."""
    base = build_model("llama-tiny")
    model = slimact.apply(copy.deepcopy(base), "invact+prac")
    assert runtime_of(model).plan == slimact.plan_of(base, "invact+prac")
    rows = _rows(model)
    actions = [a for _, a, _, _ in rows]
    assert actions.index("invnorm-check") < actions.index("prac") < actions.index("codec-policy")
    assert "rms-norm" not in actions and rows[actions.index("codec-policy") + 1] == (
        "layers.0.input_layernorm",
        "prac",
        NORM,
        False,
    )
    assert sum(c.undo is not None for c in slimact.applied(model)) == 1


def test_a_prac_family_strategy_is_applied_once():
    """One PRAC state per model: ``slimact.apply`` refuses a second PRAC rule, and the
    strategy applied part by part (its preset's part installed) a second PRAC state."""
    model = slimact.apply(build_model("llama-tiny"), "prac+recompute")
    with pytest.raises(ValueError, match=r"\(prac\) is already .* sites of every module"):
        slimact.apply(model, "pac")
    for first in ("prac", slimact.plan_of(build_model("llama-tiny"), "prac")):
        model = slimact.apply(build_model("llama-tiny"), first)
        with pytest.raises(ValueError, match=r"a PRAC-family strategy \(prac\) is already"):
            transform_of(resolve("rac")[0])(model, resolve("rac")[0], None)
        assert [r.roles for r in runtime_of(model).plan.rules] == ["prac"]


def test_a_rule_restriction_round_trips_and_is_checked():
    rule = SiteRule(codecs=(("act", "int8"),), modules=["layers.0.mlp", "", "layers.0.mlp"])
    assert rule.modules == ("layers.0.mlp", "")  # a tuple, each path once
    plan = Plan(rules=(rule,))
    d = json.loads(plan.to_json())
    assert d["rules"][0]["modules"] == ["layers.0.mlp", ""]
    assert Plan.from_dict(d) == plan
    del d["rules"][0]["modules"]  # a plan saved before rules named modules: every module
    assert Plan.from_dict(d).rules[0].modules is None
    assert "only the sites of modules: layers.0.mlp, (root)" in plan.table()
    assert rule.describe() == "act=int8; in 2 module(s)"
    assert rule.within(["layers.0", "layers.0.mlp"]).modules == ("layers.0.mlp",)
    for bad in ("layers.0", ("layers.0", 1), 5):
        with pytest.raises(ValueError, match=r"SiteRule.modules must be None \(every module\)"):
            SiteRule(codecs=(("act", "int8"),), modules=bad)
    model = build_model("llama-tiny")
    elsewhere = Plan(rules=(SiteRule(codecs=(("act", "int8"),), modules=("layers.9.mlp",)),))
    with pytest.raises(ValueError, match=r"for modules \['layers.9.mlp'\] this model does not"):
        slimact.apply(model, elsewhere)
    assert slimact.applied(model) == [] and runtime_of(model) is None


def test_a_saved_plan_keeps_the_filter_and_prac_resumes():
    """The runtime's plan carries the ``filter_fn`` (what a training checkpoint saves,
    ``train.resume``): a fresh model given that plan, and PRAC's state, trains on as the
    original run does."""
    torch.manual_seed(0)
    base = build_model("llama-tiny")
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 256, (4, 128), generator=gen) for _ in range(4)]
    run = slimact.apply(copy.deepcopy(base), "prac", first_block)
    for ids in batches[:2]:
        _same_steps([run], ids)
    saved = runtime_of(run).plan.to_json()
    state = copy.deepcopy(state_of(run).stateful["prac"].state_dict())
    resumed = slimact.apply(copy.deepcopy(base), Plan.from_dict(json.loads(saved)))
    state_of(resumed).stateful["prac"].load_state_dict(state)
    for ids in batches[2:]:
        _same_steps([run, resumed], ids)
    skipped = prac_report(resumed)["skipped"]
    assert skipped["layers.1.mlp.down_proj:linear#0"] == "filtered out by filter_fn"

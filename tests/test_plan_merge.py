"""``Plan.merge`` (``plan_a + plan_b``): both plans' actions on one model, or an error naming every
site where they cannot hold together."""

import copy

import pytest
import torch

import slimact
from slimact.models import build_model
from slimact.planner.plan import LayerPlan, Plan
from slimact.strategies.int4 import Int4Config

KIND = "LlamaBlock"


def _plan(**rows) -> Plan:
    blocks = tuple(LayerPlan(block=f"layers.{i}", kind=KIND, **rows) for i in range(2))
    return Plan("llama-tiny", 2, 32, "float32", budget="1GiB", budget_bytes=2**30, layers=blocks)


RECOMPUTE_ATTN = dict(recompute=("self_attn",))
INT8_DOWN = dict(codecs=(("int8", ("mlp.down_proj:linear#0",)),))
RECOMPUTE_MLP = dict(recompute=("mlp",))


def _grads_and_actions(plan: Plan):
    torch.manual_seed(0)
    model = slimact.apply(build_model("llama-tiny"), plan)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    with slimact.measure(model) as m:
        model(ids, targets=ids).loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return grads, {s.site: s.action for s in m.report.sites}, m.report.total_bytes


def test_a_merge_applies_both_plans_as_one_written_by_hand():
    merged = _plan(**RECOMPUTE_ATTN) + _plan(**INT8_DOWN)
    by_hand = _plan(**RECOMPUTE_ATTN, **INT8_DOWN)
    assert merged.site_actions() == by_hand.site_actions()
    assert dict(merged.meta)["merged"] == ["1GiB", "1GiB"]
    g1, a1, b1 = _grads_and_actions(merged)
    g2, a2, b2 = _grads_and_actions(by_hand)
    assert a1 == a2 and b1 == b2
    assert a1["layers.0.mlp.down_proj:linear#0"] == "codec:int8"
    assert a1["layers.1.self_attn:checkpoint_input#0"] == "keep"
    assert not any(s.startswith("layers.0.self_attn.") for s in a1)  # recomputed: nothing saved
    for name in g1:
        assert torch.equal(g1[name], g2[name]), name


def test_a_merge_with_a_rule_plan_keeps_the_layers_and_the_rules():
    """``int4`` is a plan of one lazy rule: merged with a recompute plan, the rule codes what the
    blocks still save; the merge equals applying both in one plan."""
    rule = Int4Config().plan()
    merged = _plan(**RECOMPUTE_MLP) + rule
    assert merged.rules == rule.rules and merged.layers == _plan(**RECOMPUTE_MLP).layers
    _, acts, _ = _grads_and_actions(merged)
    attn = {a for s, a in acts.items() if s.startswith("layers.0.self_attn.")}
    assert any(a.startswith("codec:int4") for a in attn), attn  # the rule codes what is saved
    assert not any(s.startswith("layers.0.mlp.") for s in acts)  # recomputed: nothing saved


def test_merging_a_plan_with_itself_changes_no_action():
    p = _plan(**RECOMPUTE_ATTN, **INT8_DOWN)
    assert (p + copy.deepcopy(p)).site_actions() == p.site_actions()


def test_two_codecs_on_one_site_are_refused_naming_the_site():
    other = _plan(codecs=(("int4", ("mlp.down_proj:linear#0",)),))
    with pytest.raises(ValueError, match=r"two codecs on layers\.0\.mlp\.down_proj:linear#0"):
        _plan(**INT8_DOWN) + other


def test_a_codec_inside_a_module_the_other_plan_recomputes_is_refused():
    coded = _plan(codecs=(("int8", ("mlp.down_proj:linear#0",)),))
    with pytest.raises(ValueError) as err:
        coded + _plan(**RECOMPUTE_MLP)
    text = str(err.value)
    assert "layers.0.mlp.down_proj:linear#0, inside layers.0.mlp" in text
    assert "layers.1.mlp.down_proj:linear#0" in text  # every conflicting site, not the first


def test_other_conflicts_are_named():
    with pytest.raises(ValueError, match="recomputed in one plan and reformulated"):
        _plan(**RECOMPUTE_MLP) + _plan(reform=("mlp",))
    with pytest.raises(ValueError, match="two models"):
        _plan() + Plan("llama-20m")
    wrong_kind = Plan("llama-tiny", layers=(LayerPlan(block="layers.0", kind="GPT2Block"),))
    with pytest.raises(ValueError, match="layers.0 is a LlamaBlock in one plan and a GPT2Block"):
        _plan() + wrong_kind
    int8 = Int4Config(act="int8").plan()
    with pytest.raises(ValueError, match="role 'act' two codecs"):
        Int4Config().plan() + int8
    with pytest.raises(TypeError, match="not str"):
        _plan().merge("int4")


def _in_block(block: str):
    return lambda m, path: path == block or path.startswith(block + ".")


def test_rules_for_disjoint_modules_merge_and_each_codes_its_own():
    """A codec rule restricted by a ``filter_fn`` to some modules (``SiteRule.modules``) holds
    beside another restricted to others: INT4 in block 0, INT8 in block 1, both on one runtime,
    each block's sites coded by its own rule and the root's kept. Overlapping scopes that give one
    role two codecs, or mix site roles with PRAC's, are refused naming the modules."""
    torch.manual_seed(0)
    model = build_model("llama-tiny")
    int4 = slimact.plan_of(model, "int4", _in_block("layers.0"))
    int8 = slimact.plan_of(model, "int8", _in_block("layers.1"))
    int4_in_1 = slimact.plan_of(model, "int4", _in_block("layers.1"))
    both = int4 + int8
    assert len(both.rules) == 2
    slimact.apply(model, both)
    ids = torch.randint(0, 256, (4, 128), generator=torch.Generator().manual_seed(0))
    with slimact.measure(model) as meter:
        model(ids, targets=ids).loss.backward()
    coded = {s.site: s.action for s in meter.report.sites if s.action.startswith("codec:")}
    in0 = {a for s, a in coded.items() if s.startswith("layers.0.")}
    in1 = {a for s, a in coded.items() if s.startswith("layers.1.")}
    assert in0 and in1 and all(s.startswith(("layers.0.", "layers.1.")) for s in coded)
    assert any("int4" in a for a in in0) and not any("int4" in a for a in in1)
    assert all("int8" in a for a in in1)
    with pytest.raises(ValueError, match=r"role 'act' two codecs in modules layers\.1"):
        int8 + int4_in_1
    with pytest.raises(ValueError, match="role 'act' two codecs in every module"):
        Int4Config().plan() + int8
    with pytest.raises(ValueError, match=r"every module by different roles \('prac' and 'site'\)"):
        slimact.plan_of(build_model("llama-tiny"), "prac") + int8
    prac = slimact.plan_of(build_model("llama-tiny"), "prac", _in_block("layers.0"))
    with pytest.raises(ValueError, match="two PRAC rules"):
        prac + slimact.plan_of(build_model("llama-tiny"), "prac", _in_block("layers.1"))
